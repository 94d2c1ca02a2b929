"""Copy a run's profile files to object storage (``s3://bucket/prefix``) with boto3.

Credentials, region and endpoint come from the standard AWS chain (environment, profile,
instance or pod role; ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for MinIO, R2 or moto),
never from the campaign file (``campaigns/object_store.py`` parses the URL and opens the client).
"""

from __future__ import annotations

from pathlib import Path

from campaigns.object_store import parse_s3_url, s3_client


def upload_files(files: list[Path], base_dir: Path, url: str, client=None) -> list[str]:
    """Upload ``files`` (under ``base_dir``) to ``url``/<path relative to base_dir>; return the object URLs."""
    dest = parse_s3_url(url, "profile upload URL")
    client = client or s3_client()
    out = []
    for f in files:
        key = dest.join(Path(f).relative_to(base_dir).as_posix())
        client.upload_file(str(f), dest.bucket, key)
        out.append(f"s3://{dest.bucket}/{key}")
    return out
