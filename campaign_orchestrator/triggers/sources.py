"""A campaign's prompt source as a list of files identified by content hash.

``data.source`` is a local file or glob (relative to the repository root, or absolute) or an S3
URI ``s3://bucket/prefix/<glob>`` (the glob applies to the key after the bucket, e.g.
``s3://drops/cipher/*.jsonl``). S3 is reached with boto3's default credential chain and
endpoint settings (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...), like every boto3 tool.

Hashing is the expensive part, so callers pass a stat cache: a file whose (size, mtime) for
local files, or (size, ETag) for S3 objects, is unchanged is not read again.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from campaigns.object_store import is_s3_url, parse_s3_url, s3_client

_CHUNK = 1 << 20


class SourceError(ValueError):
    """The prompt source cannot be listed or read; the message names the source and the fix."""


@dataclass(frozen=True)
class SourceFile:
    uri: str  # absolute path or s3://bucket/key
    name: str  # file name (last path component)
    size: int
    stamp: str  # changes whenever the file may have changed: size:mtime_ns or size:etag
    sha256: str
    rows: int  # non-empty lines (JSONL records)


def split_s3(source: str) -> tuple[str, str]:
    """``s3://bucket/a/b/*.jsonl`` -> (``bucket``, ``a/b/*.jsonl``); a trailing ``/`` is kept (a folder)."""
    try:
        url = parse_s3_url(source, "data.source")
    except ValueError as e:
        raise SourceError(f"{e}; e.g. s3://drops/prompts/*.jsonl") from None
    return url.bucket, url.key + "/" if url.key and source.endswith("/") else url.key


def _literal_prefix(pattern: str) -> str:
    """The part of a glob before its first wildcard (what S3 can filter on)."""
    cut = min((i for i, c in enumerate(pattern) if c in "*?["), default=len(pattern))
    return pattern[:cut]


def content_digest(chunks: Iterator[bytes]) -> tuple[str, int]:
    """(sha256, number of non-empty lines) of a byte stream, in one pass."""
    h = hashlib.sha256()
    rows = 0
    pending = b""
    for chunk in chunks:
        h.update(chunk)
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        rows += sum(1 for line in lines if line.strip())
    if pending.strip():
        rows += 1
    return h.hexdigest(), rows


def _file_chunks(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def list_local(source: str, base_dir: str | Path, cache: dict[str, list[str]] | None = None) -> list[SourceFile]:
    p = Path(source)
    full = str(p if p.is_absolute() else Path(base_dir) / p)
    cache = cache if cache is not None else {}
    out = []
    for f in sorted(glob.glob(full, recursive=True)):
        if not os.path.isfile(f):
            continue
        st = os.stat(f)
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
        hit = cache.get(f)
        if hit and hit[0] == stamp:
            sha, rows = hit[1], int(hit[2])
        else:
            sha, rows = content_digest(_file_chunks(f))
        out.append(SourceFile(f, os.path.basename(f), st.st_size, stamp, sha, rows))
    return out


def list_s3(source: str, cache: dict[str, list[str]] | None = None, client=None) -> list[SourceFile]:
    bucket, pattern = split_s3(source)
    cache = cache if cache is not None else {}
    client = client or s3_client()
    prefix = _literal_prefix(pattern)
    out = []
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/") or (pattern != prefix and not fnmatch.fnmatchcase(key, pattern)):
                    continue
                uri = f"s3://{bucket}/{key}"
                stamp = f"{obj['Size']}:{obj.get('ETag', '').strip(chr(34))}"
                hit = cache.get(uri)
                if hit and hit[0] == stamp:
                    sha, rows = hit[1], int(hit[2])
                else:
                    sha, rows = _hash_object(client, bucket, key)
                out.append(SourceFile(uri, key.rsplit("/", 1)[-1], int(obj["Size"]), stamp, sha, rows))
    except Exception as e:  # botocore raises ClientError / EndpointConnectionError / NoCredentialsError
        if isinstance(e, SourceError):
            raise
        raise SourceError(
            f"data.source {source!r}: cannot list s3://{bucket}/{prefix}: {type(e).__name__}: {e}"
        ) from None
    return sorted(out, key=lambda f: f.uri)


def _hash_object(client, bucket: str, key: str, save_to: Path | None = None) -> tuple[str, int]:
    """Stream an object once: its (sha256, rows), optionally writing it to ``save_to`` as it goes."""
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    chunks = iter(lambda: body.read(_CHUNK), b"")
    if save_to is None:
        return content_digest(chunks)
    with open(save_to, "wb") as f:

        def tee():
            for c in chunks:
                f.write(c)
                yield c

        return content_digest(tee())


def list_source(
    source: str, base_dir: str | Path, cache: dict[str, list[str]] | None = None, client=None
) -> list[SourceFile]:
    """Every file of the source with its content hash and row count (cache: uri -> [stamp, sha, rows])."""
    if is_s3_url(source):
        return list_s3(source, cache, client)
    return list_local(source, base_dir, cache)


def fetch_s3_source(source: str, dest: str | Path, client=None) -> list[Path]:
    """Download the objects of an ``s3://`` source into ``dest/<sha256>/<name>`` and return the
    local files in key order. Content-addressed: an object whose (size, ETag) was seen before is
    not downloaded again (``dest/index.json`` remembers them)."""
    import json

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    index_path = dest / "index.json"
    index: dict[str, list[str]] = json.loads(index_path.read_text()) if index_path.exists() else {}
    client = client or s3_client()
    bucket, _ = split_s3(source)
    out = []
    for f in list_s3(source, cache=index, client=client):
        local = dest / f.sha256 / f.name
        if not local.exists():
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(local.name + ".tmp")
            sha, _ = _hash_object(client, bucket, f.uri[len(f"s3://{bucket}/") :], save_to=tmp)
            if sha != f.sha256:  # replaced between listing and download: keep the bytes we got
                local = dest / sha / f.name
                local.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, local)
        index[f.uri] = [f.stamp, f.sha256, str(f.rows)]
        out.append(local)
    if not out:
        raise SourceError(f"data.source {source!r}: no objects match; check the bucket, prefix and glob")
    tmp_index = index_path.with_name("index.json.tmp")
    tmp_index.write_text(json.dumps(index, indent=1, sort_keys=True))
    os.replace(tmp_index, index_path)
    return out


def unique_by_content(files: list[Path]) -> list[Path]:
    """The files in order, without later copies of an earlier file's exact content."""
    from campaign_orchestrator.content import file_sha256

    seen, out = set(), []
    for f in files:
        h = file_sha256(f)
        if h not in seen:
            seen.add(h)
            out.append(f)
    return out


def prompt_files(source: str, base_dir: str | Path, s3_cache_dir: str | Path) -> list[Path]:
    """Local files of a prompt source, one per distinct content: local globs as they are, S3
    objects downloaded (content-addressed) under ``s3_cache_dir``."""
    from campaign_orchestrator.dataset.prompts import source_files

    files = fetch_s3_source(source, s3_cache_dir) if is_s3_url(source) else source_files(source, base_dir)
    return unique_by_content(files)
