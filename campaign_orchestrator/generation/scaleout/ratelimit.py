"""One set of rate limits for a whole Ray job: token buckets held by a named actor that every worker reserves from.

An endpoint teacher's ``requests_per_minute`` and ``tokens_per_minute`` bind the job, not each worker: with
four workers, per-worker buckets would send four times the allowed rate. :func:`shared_buckets` starts (or
finds) the job's :class:`RateLimits` actor, named after the job, and returns the ``(rpm, tpm)`` pair of
:class:`SharedBucket` handles a worker gives its client (``OpenAICompatibleClient.buckets``); each
``acquire`` is one small actor call that *reserves* units and says how long to wait before using them
(virtual scheduling: reservations are served in the order they arrive, so the job never exceeds the rate,
whatever the number of workers).
"""

from __future__ import annotations

import asyncio
import time


class BucketState:
    """A token bucket that reserves ahead: ``per_minute`` units a minute, holding at most one second's worth
    (as :class:`campaign_orchestrator.generation.openai_client.TokenBucket`), tokens may go negative (owed)."""

    def __init__(self, per_minute: float, clock=time.monotonic):
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, self.rate)
        self.tokens = self.capacity
        self.clock = clock
        self.t = clock()

    def reserve(self, amount: float) -> float:
        """Take ``amount`` units; the seconds the caller waits before using them (0: now)."""
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.t) * self.rate)
        self.t = now
        need = min(amount, self.capacity)
        wait = max(0.0, (need - self.tokens) / self.rate)
        self.tokens -= amount
        return wait

    def refund(self, amount: float) -> None:
        self.tokens = min(self.capacity, self.tokens + amount)


class RateLimits:
    """The job's buckets (a Ray actor, one per job): ``reserve(kind, amount)`` / ``refund(kind, amount)``,
    kind ``rpm`` or ``tpm``."""

    def __init__(self, requests_per_minute: float | None, tokens_per_minute: float | None):
        self.buckets = {k: BucketState(v) for k, v in (("rpm", requests_per_minute), ("tpm", tokens_per_minute)) if v}
        self.reserved = {k: 0.0 for k in self.buckets}

    def reserve(self, kind: str, amount: float) -> float:
        self.reserved[kind] += amount
        return self.buckets[kind].reserve(amount)

    def refund(self, kind: str, amount: float) -> None:
        self.reserved[kind] -= amount
        self.buckets[kind].refund(amount)

    def stats(self) -> dict:
        return {"reserved": dict(self.reserved)}


class SharedBucket:
    """What a worker's client holds: ``TokenBucket``'s async ``acquire``/``refund``, served by the job's actor."""

    def __init__(self, actor, kind: str):
        self.actor, self.kind = actor, kind

    async def acquire(self, amount: float = 1.0) -> None:
        wait = await self.actor.reserve.remote(self.kind, float(amount))
        if wait > 0:
            await asyncio.sleep(wait)

    def refund(self, amount: float) -> None:
        self.actor.refund.remote(self.kind, float(amount))  # fire and forget: a refund never delays a request


def limiter_name(job_id: str) -> str:
    return f"campaign-rate-limits-{job_id}"


def start_limits(job_id: str, requests_per_minute: float | None, tokens_per_minute: float | None):
    """The driver starts the job's :class:`RateLimits` actor (None when the teacher has no limits)."""
    if not requests_per_minute and not tokens_per_minute:
        return None
    import ray

    cls = ray.remote(num_cpus=0)(RateLimits)
    return cls.options(name=limiter_name(job_id), lifetime=None).remote(requests_per_minute, tokens_per_minute)


def shared_buckets(job_id: str) -> tuple[SharedBucket | None, SharedBucket | None]:
    """A worker's ``(rpm, tpm)`` handles on the job's buckets (``(None, None)``: the job has no limits)."""
    import ray

    try:
        actor = ray.get_actor(limiter_name(job_id))
    except ValueError:
        return None, None
    kinds = ray.get(actor.stats.remote())["reserved"]
    return (
        SharedBucket(actor, "rpm") if "rpm" in kinds else None,
        SharedBucket(actor, "tpm") if "tpm" in kinds else None,
    )
