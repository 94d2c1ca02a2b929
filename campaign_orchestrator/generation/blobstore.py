"""A minimal object store: a local directory or an S3 bucket (boto3), same methods.

Keys are ``/``-separated relative names. ``put`` is atomic in both stores (a local write goes
to a temporary file that is renamed into place; an S3 PUT is atomic by nature), so a reader
never sees half an object. boto3 is imported only when an S3 store is opened.

Besides whole objects, both stores read byte ranges (``read_range``, ``read_tail``: the generation cache reads a
Parquet footer and the row groups that can hold the keys it asks for, not the whole file), and move whole objects
to and from local files without holding them in memory (``download``, ``upload``). A missing object raises
:class:`MissingObject` from every read.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Protocol

from campaigns.object_store import is_s3_url, parse_s3_url, s3_client


class BlobStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def list(self, prefix: str, recursive: bool = True) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...
    def read_range(self, key: str, start: int, end: int) -> bytes: ...
    def read_tail(self, key: str, n: int) -> tuple[bytes, int]: ...
    def download(self, key: str, dest: Path) -> None: ...
    def upload(self, key: str, src: Path) -> None: ...


class StoreError(RuntimeError):
    pass


class MissingObject(StoreError, FileNotFoundError):
    """The object is not (or no longer) in the store: e.g. a compaction replaced it after it was listed."""


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

    def list(self, prefix: str, recursive: bool = True) -> list[str]:
        """Keys under the folder ``prefix``; ``recursive=False``: only those directly in it."""
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root))
            for p in (base.rglob("*") if recursive else base.iterdir())
            if not p.name.startswith(".") and p.is_file()
        )

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def local_path(self, key: str) -> Path:
        """Where the object is on this machine (readers open it directly)."""
        return self._path(key)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(max(0, end - start))
        except FileNotFoundError as e:
            raise MissingObject(f"{self.url}/{key} does not exist") from e

    def read_tail(self, key: str, n: int) -> tuple[bytes, int]:
        try:
            with open(self._path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - n))
                return f.read(), size
        except FileNotFoundError as e:
            raise MissingObject(f"{self.url}/{key} does not exist") from e

    def download(self, key: str, dest: Path) -> None:
        try:
            shutil.copyfile(self._path(key), dest)
        except FileNotFoundError as e:
            raise MissingObject(f"{self.url}/{key} does not exist") from e

    def upload(self, key: str, src: Path) -> None:
        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, p)


class S3Store:
    """Objects under ``s3://bucket/prefix/``. Credentials come from the usual boto3 chain
    (environment, profile, instance role); ``endpoint_url`` points at any S3-compatible
    service (MinIO, R2, moto)."""

    def __init__(
        self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str | None = None, client=None
    ):
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

    def _missing(self, e: Exception) -> bool:
        code = getattr(e, "response", {}).get("Error", {}).get("Code")
        return code in ("404", "NoSuchKey", "NotFound")

    def get(self, key: str) -> bytes:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read()
        except Exception as e:
            if self._missing(e):
                raise MissingObject(f"{self.url}/{key} does not exist") from e
            raise self._err("GET", key, e) from e

    def _ranged(self, key: str, rng: str) -> dict:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self._k(key), Range=rng)
        except Exception as e:
            if self._missing(e):
                raise MissingObject(f"{self.url}/{key} does not exist") from e
            raise self._err(f"GET ({rng})", key, e) from e

    def read_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return self._ranged(key, f"bytes={start}-{end - 1}")["Body"].read()

    def read_tail(self, key: str, n: int) -> tuple[bytes, int]:
        """The last ``n`` bytes and the object's size, in one GET (a suffix range)."""
        r = self._ranged(key, f"bytes=-{n}")
        data = r["Body"].read()
        cr = r.get("ContentRange") or ""
        size = int(cr.rsplit("/", 1)[1]) if "/" in cr else len(data)
        return data, size

    def download(self, key: str, dest: Path) -> None:
        """Stream the object to ``dest`` (never held in memory whole)."""
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self._k(key))["Body"]
            with open(dest, "wb") as f:
                for chunk in body.iter_chunks(1 << 20):
                    f.write(chunk)
        except Exception as e:
            if self._missing(e):
                raise MissingObject(f"{self.url}/{key} does not exist") from e
            raise self._err("GET", key, e) from e

    def upload(self, key: str, src: Path) -> None:
        """Stream ``src`` to the object (multipart when large: boto3's transfer manager)."""
        try:
            self.s3.upload_file(str(src), self.bucket, self._k(key))
        except Exception as e:
            raise self._err("PUT", key, e) from e

    def list(self, prefix: str, recursive: bool = True) -> list[str]:
        """Keys under ``prefix``; ``recursive=False``: only those directly in the folder ``prefix`` (a delimited
        LIST: the sub-folders' objects are not sent)."""
        full = self._k(prefix)
        cut = len(self.prefix) + 1 if self.prefix else 0
        out: list[str] = []
        extra = {} if recursive else {"Delimiter": "/"}
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full, **extra):
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
