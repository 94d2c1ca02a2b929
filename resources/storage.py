"""The ``storage`` resource: where artifacts and the generation cache live. It holds the settings and hands the
stages a plain :class:`stages.storage.Store` (``store()``); its methods are the store's, for the code that holds the
resource (sensors, the CLI).

Stage directories stay on the local root (the trainer and evaluation read them as files). The generation cache may
live in S3 where several machines (or a fresh pod) find it: set ``cache_url: s3://bucket/prefix`` (credentials from
the usual boto3 chain: environment, profile, instance or pod role; ``s3_endpoint_url`` for MinIO, R2 or any
S3-compatible service). Spool files of in-progress generations always stay local under ``<root>/cache/spool``.
"""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field

from stages.storage import Store


class ArtifactStore(ConfigurableResource):
    """Local artifact root (relative paths are relative to the project directory, ``campaigns.paths``)."""

    root: str = Field("artifacts", description="Directory holding every campaign's artifacts and the demo models.")
    cache_url: str | None = Field(
        None, description="Generation cache location: a directory, or s3://bucket/prefix (default: <root>/cache)."
    )
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, R2, ...); default: AWS.")
    s3_region: str | None = Field(None, description="S3 region; default: the boto3 configuration's.")

    def store(self) -> Store:
        """The plain store these settings describe (what the stages get)."""
        return Store(self.root, self.cache_url, self.s3_endpoint_url, self.s3_region)

    def root_path(self) -> Path:
        return self.store().root_path()

    def stage(self, campaign: str, stage: str, key: str):
        return self.store().stage(campaign, stage, key)

    def cache_store(self):
        return self.store().cache_store()

    def spool_dir(self) -> Path:
        return self.store().spool_dir()

    def campaign_dir(self, campaign: str) -> Path:
        return self.store().campaign_dir(campaign)

    def resolve_model(self, ref: str, base: Path | None = None, revision: str | None = None, log=None) -> Path:
        return self.store().resolve_model(ref, base, revision, log=log)
