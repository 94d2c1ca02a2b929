"""Object-store URLs (``s3://bucket/key``) and the boto3 client: the one parser and the one client factory.

Every place that reads or writes S3 (the trainer's checkpoint mirror and profile upload, the prompt source
of a trigger, a model stored in S3, the teacher's generation cache, an lm_eval task folder) and the spec's
validation of an ``s3://`` field parse the URL with :func:`parse_s3_url` and open the client with
:func:`s3_client`. Credentials, region and endpoint come from the standard AWS
chain (environment, profile, instance or pod role; ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for MinIO,
R2 or moto), never from a campaign file; a caller with an explicit endpoint passes it. boto3 is imported
only when a client is opened. Standard library only otherwise; it lives in the bottom layer of
``[tool.importlinter]`` so that every package may import it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

SCHEME = "s3://"
# bucket names: 3-63 characters of lower-case letters, digits, dots and hyphens, starting and ending with a
# letter or digit (the S3 naming rules); the key is everything after the first slash
_S3_URL = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<key>.*))?$")


class S3Url(NamedTuple):
    bucket: str
    key: str  # without leading or trailing slashes; "" for the whole bucket

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    def join(self, *parts: str) -> str:
        """The object key of ``parts`` under this URL's key (``/``-joined, empty parts left out)."""
        return "/".join(p.strip("/") for p in (self.key, *parts) if p and p.strip("/"))


def is_s3_url(value: object) -> bool:
    """Whether ``value`` names an object-store location (``s3://...``) rather than a local path."""
    return str(value).startswith(SCHEME)


def parse_s3_url(url: str, what: str = "URL") -> S3Url:
    """``s3://bucket/a/b/`` -> ``S3Url("bucket", "a/b")``. ``what`` names the field in the error, which says
    what a valid value looks like."""
    m = _S3_URL.match(str(url))
    if not m:
        raise ValueError(
            f"{what} {url!r} is not an S3 URL: expected s3://bucket[/prefix], with a bucket name of "
            "3-63 lower-case letters, digits, dots or hyphens"
        )
    return S3Url(m.group("bucket"), (m.group("key") or "").strip("/"))


def s3_client(
    endpoint_url: str | None = None,
    region: str | None = None,
    max_attempts: int = 5,
    connect_timeout: float = 10,
    read_timeout: float = 60,
):
    """A boto3 S3 client with standard retries (``max_attempts`` tries of a throttled or failed call)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        config=Config(
            retries={"max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        ),
    )
