"""Copy a run's profile files to object storage (``s3://bucket/prefix``) with boto3.

Credentials, region and endpoint come from the standard AWS chain (environment, profile,
instance or pod role; ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for MinIO, R2 or moto),
never from the campaign file. boto3 is imported only when something is uploaded.
"""

from __future__ import annotations

import re
from pathlib import Path

S3_URL = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<prefix>.*))?$")


def parse_s3_url(url: str) -> tuple[str, str]:
    m = S3_URL.match(url)
    if not m:
        raise ValueError(f"expected s3://bucket[/prefix], got {url!r}")
    return m.group("bucket"), (m.group("prefix") or "").strip("/")


def upload_files(files: list[Path], base_dir: Path, url: str, client=None) -> list[str]:
    """Upload ``files`` (under ``base_dir``) to ``url``/<path relative to base_dir>; return the object URLs."""
    bucket, prefix = parse_s3_url(url)
    if client is None:
        import boto3

        client = boto3.client("s3")
    out = []
    for f in files:
        key = "/".join(x for x in (prefix, Path(f).relative_to(base_dir).as_posix()) if x)
        client.upload_file(str(f), bucket, key)
        out.append(f"s3://{bucket}/{key}")
    return out
