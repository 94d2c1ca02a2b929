"""A minimal object store: a local directory or an S3 bucket (boto3), same five methods.

Keys are ``/``-separated relative names. ``put`` is atomic in both stores (a local write goes
to a temporary file that is renamed into place; an S3 PUT is atomic by nature), so a reader
never sees half an object. boto3 is imported only when an S3 store is opened.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Protocol

from campaigns.object_store import is_s3_url, parse_s3_url, s3_client


class BlobStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def list(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...


class StoreError(RuntimeError):
    pass


class LocalStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad store key {key!r}")
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, p)

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*")
                      if p.is_file() and not p.name.startswith("."))

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()


class S3Store:
    """Objects under ``s3://bucket/prefix/``. Credentials come from the usual boto3 chain
    (environment, profile, instance role); ``endpoint_url`` points at any S3-compatible
    service (MinIO, R2, moto)."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str | None = None,
                 client=None):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        if client is None:
            client = s3_client(endpoint_url=endpoint_url, region=region)
        self.s3 = client

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _err(self, what: str, key: str, e: Exception) -> StoreError:
        return StoreError(f"S3 {what} {self.url}/{key} failed: {type(e).__name__}: {e}")

    def put(self, key: str, data: bytes) -> None:
        try:
            self.s3.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)
        except Exception as e:  # botocore raises many unrelated types; name the object in every case
            raise self._err("PUT", key, e) from e

    def get(self, key: str) -> bytes:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read()
        except Exception as e:
            raise self._err("GET", key, e) from e

    def list(self, prefix: str) -> list[str]:
        full = self._k(prefix)
        cut = len(self.prefix) + 1 if self.prefix else 0
        out: list[str] = []
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                out += [o["Key"][cut:] for o in page.get("Contents", [])]
        except Exception as e:
            raise self._err("LIST", prefix, e) from e
        return sorted(out)

    def delete(self, key: str) -> None:
        try:
            self.s3.delete_object(Bucket=self.bucket, Key=self._k(key))
        except Exception as e:
            raise self._err("DELETE", key, e) from e

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.s3.head_object(Bucket=self.bucket, Key=self._k(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._err("HEAD", key, e) from e


def open_store(url: str | Path, endpoint_url: str | None = None, region: str | None = None) -> LocalStore | S3Store:
    """``s3://bucket/prefix`` opens an :class:`S3Store`; anything else is a local directory."""
    s = str(url)
    if is_s3_url(s):
        u = parse_s3_url(s, "generation cache URL")
        return S3Store(u.bucket, u.key, endpoint_url=endpoint_url, region=region)
    return LocalStore(s)
