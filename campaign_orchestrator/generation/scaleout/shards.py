"""Shards: a stage's distinct requests cut into fixed groups by content, so a re-run forms the same shards.

The requests are sorted by their content-addressed key (:func:`campaign_orchestrator.generation.requests.request_key`)
and cut every ``size``; a shard's id is the hash of its sorted keys. The same prompts asked of the same model
with the same settings always give the same shards, whatever order the prompt table lists them in, and a
shard's id says exactly which requests it holds (the ledger's and the run log's name for it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def shard_id(keys: Iterable[str]) -> str:
    """16 hex digits of the sha256 of the sorted request keys."""
    h = hashlib.sha256()
    for k in sorted(keys):
        h.update(k.encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


@dataclass
class Shard:
    """One unit of work: its id, its index among the stage's shards and its requests (GenRequest)."""

    id: str
    index: int
    requests: list = field(default_factory=list)

    @property
    def keys(self) -> list[str]:
        return [r.key for r in self.requests]

    def __len__(self) -> int:
        return len(self.requests)


def make_shards(requests: Sequence, size: int) -> list[Shard]:
    """The distinct ``requests`` (objects with a ``key``) in shards of at most ``size``, by sorted key."""
    if size < 1:
        raise ValueError(f"shard size must be at least 1, got {size}")
    distinct = sorted({r.key: r for r in requests}.values(), key=lambda r: r.key)
    out = []
    for i, start in enumerate(range(0, len(distinct), size)):
        part = distinct[start : start + size]
        out.append(Shard(shard_id(r.key for r in part), i, part))
    return out
