"""The artifact store as a plain object: one root directory, stage directories keyed by content hash, and the
generation cache (``<root>/cache`` by default, or an S3 bucket through boto3). The ``storage`` resource
(``resources/storage.py``) holds its settings and hands one of these to the stages.

Stage directories stay on the local root (the trainer and evaluation read them as files). The generation cache is
shared across campaigns and re-runs, so it may live in S3 where several machines (or a fresh pod) find it:
``cache_url: s3://bucket/prefix`` (credentials from the usual boto3 chain; ``s3_endpoint_url`` for MinIO, R2 or
any S3-compatible service). Spool files of in-progress generations always stay local under ``<root>/cache/spool``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from campaign_orchestrator import models
from campaign_orchestrator.stage_dir import StageDir
from campaigns import paths
from campaigns.object_store import is_s3_url


@dataclass(frozen=True)
class Store:
    """Local artifact root (relative paths are relative to the project directory, ``campaigns.paths``)."""

    root: str = "artifacts"
    cache_url: str | None = None
    s3_endpoint_url: str | None = None
    s3_region: str | None = None

    def root_path(self) -> Path:
        return paths.artifact_root(self.root)

    def stage(self, campaign: str, stage: str, key: str) -> StageDir:
        return StageDir(self.root_path(), campaign, stage, key)

    def cache_store(self):
        """The generation cache's object store (:mod:`campaign_orchestrator.generation.blobstore`)."""
        from campaign_orchestrator.generation.blobstore import open_store

        url = self.cache_url or str(self.root_path() / "cache")
        if not is_s3_url(url):
            url = str(paths.resolve(url))
        return open_store(url, endpoint_url=self.s3_endpoint_url, region=self.s3_region)

    def spool_dir(self) -> Path:
        """Local directory for spool files of generations in progress."""
        return self.root_path() / "cache" / "spool"

    def campaign_dir(self, campaign: str) -> Path:
        return self.root_path() / campaign

    def resolve_model(self, ref: str, base: Path | None = None, revision: str | None = None, log=None) -> Path:
        """A campaign's model reference as a checkpoint directory (:func:`campaign_orchestrator.models.resolve`:
        ``@demo/<name>``, a directory or ``.gguf`` file relative to ``base``, ``s3://``, a hub id)."""
        return models.resolve(ref, self.root_path(), base, revision, log=log)
