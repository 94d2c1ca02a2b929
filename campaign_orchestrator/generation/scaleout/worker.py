"""The worker: one Ray actor holding one model replica, answering one shard at a time into the cache.

:class:`GenerationWorker` is a plain class (``ray.remote`` is applied by the pool, :func:`worker_class`), so
it is importable and testable without Ray. It builds its engine once from a recipe, owns a writer of the
generation cache (its own spool directory), and per shard: looks the shard's keys up, asks only what the cache lacks,
writes each finished generation to its spool as it finishes (flushed per
row: it survives this process's death) and seals the shard into one Parquet file of the cache at the end.
``progress()`` (answered while a shard runs: the actor has two threads) tells the driver what the running
shard has paid for so far.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class CacheConfig:
    """Where the generation cache is: the store URL (a directory or ``s3://``), its S3 settings, the
    namespace and the local spool directory (paths are as the worker's node sees them)."""

    store_url: str
    namespace: str
    spool_dir: str
    s3_endpoint_url: str | None = None
    s3_region: str | None = None

    def open(self, shard_rows: int = 256, shard_seconds: float = 15.0, worker: str | None = None):
        """The cache; ``worker``: a worker's own spool directory (``<spool_dir>/workers/<worker>``), so no other
        process's recovery ever races a live worker opening a spool."""
        from campaign_orchestrator.generation.blobstore import open_store
        from campaign_orchestrator.generation.cache import GenerationCache

        store = open_store(self.store_url, endpoint_url=self.s3_endpoint_url, region=self.s3_region)
        spool = Path(self.spool_dir) / "workers" / worker if worker else self.spool_dir
        return GenerationCache(store, self.namespace, spool, shard_rows=shard_rows, shard_seconds=shard_seconds)

    def recover(self, worker: str | None = None, on_rows=None) -> int:
        """Seal what dead writers left: one worker's spool directory, or (``worker`` None: only when no worker of
        this cache is writing) the driver's and every worker's. ``on_rows(rows)``: called with each sealed spool's
        rows (what a dead worker answered, with their token counts: the pool bills them)."""
        if worker:
            return self.open(worker=worker).recover(on_rows)
        n = self.open().recover(on_rows)
        workers = Path(self.spool_dir) / "workers"
        for d in sorted(workers.iterdir()) if workers.is_dir() else []:
            n += self.open(worker=d.name).recover(on_rows)
        return n


@dataclass
class ShardProgress:
    """What one attempt of one shard has done so far (counters only grow)."""

    shard: str
    attempt: int
    to_ask: int = 0  # requests of the shard the cache lacked when it started
    cached: int = 0  # requests of the shard already in the cache
    generated: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # generation time so far (the backend's clock at the end)
    done: bool = False
    failed_rows: dict = field(default_factory=dict)  # key -> cache row with its error (errors are never cached)
    backend_stats: dict = field(default_factory=dict)


class GenerationWorker:
    """One model replica. Each shard comes with its ``recipe`` (a :class:`~campaign_orchestrator.generation.factories.
    BackendFactory`: a teacher backend, or an :class:`~campaign_orchestrator.generation.scaleout.job.AnswerFactory`: a
    local
    model answering evaluation prompts) and its cache; the engine is built on the first shard of a recipe and
    kept while the next shards bring the same recipe (one process serves a stage's models one after the other:
    its interpreter, torch and the Ray worker start once). ``limits``: the name of the job's shared rate limits."""

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self.recipe = None
        self.backend = None
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._current: ShardProgress | None = None
        import uuid

        self.spool = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"  # this worker's own spool directory
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(threads)

    # ------------------------------------------------------------------ identity, set-up
    def where(self) -> dict:
        """The worker as a shard failure names it: node, actor, process."""
        out = {"pid": os.getpid(), "host": os.uname().nodename, "spool": self.spool}
        try:
            import ray

            ctx = ray.get_runtime_context()
            out |= {
                "node_id": ctx.get_node_id(),
                "actor_id": ctx.get_actor_id(),
                "node_ip": ray.util.get_node_ip_address(),
            }
        except Exception:  # noqa: BLE001 - outside Ray (unit tests)
            pass
        return out

    def ready(self) -> dict:
        return self.where()

    def _build(self, recipe):
        with self._build_lock:
            if self.backend is None or recipe != self.recipe:
                self.backend = None  # the previous model goes before the next loads
                import gc

                gc.collect()
                backend = recipe.build()
                getattr(backend, "local_model", None)  # a local model loads now, not inside a shard's clock
                if self.threads and "torch" in sys.modules:
                    sys.modules["torch"].set_num_threads(self.threads)
                self.backend, self.recipe = backend, recipe
            return self.backend

    # ------------------------------------------------------------------ work
    def progress(self) -> dict | None:
        with self._lock:
            return None if self._current is None else asdict(self._current) | {"failed_rows": {}}

    def run_shard(
        self,
        recipe,
        cache: CacheConfig,
        shard_id: str,
        attempt: int,
        requests: list,
        sampling,
        limits: str | None = None,
    ) -> dict:
        """Answer what the cache lacks of one shard; returns its :class:`ShardProgress` as a dict."""
        from campaign_orchestrator.generation.runner import _cache_row

        backend = self._build(recipe)
        client = getattr(backend, "client", None)
        if client is not None and hasattr(client, "buckets"):
            from campaign_orchestrator.generation.scaleout.ratelimit import shared_buckets

            buckets = shared_buckets(limits) if limits else (None, None)
            client.buckets = buckets if buckets != (None, None) else None  # the job's buckets, not this worker's
        journal = None
        if client is not None and hasattr(client, "journal"):  # what each request may cost and each answer did
            from campaign_orchestrator.generation.scaleout.journal import UsageJournal, journal_path

            journal = client.journal = UsageJournal(journal_path(cache.spool_dir, self.spool, shard_id, attempt))
        gc = cache.open(shard_rows=max(256, len(requests) + 1), shard_seconds=float("inf"), worker=self.spool)
        found = gc.lookup(r.key for r in requests)
        todo = [r for r in requests if r.key not in found]
        prog = ShardProgress(shard_id, attempt, to_ask=len(todo), cached=len(requests) - len(todo))
        with self._lock:
            self._current = prog
        t0 = time.perf_counter()
        g0 = getattr(backend, "generate_s", None)
        s0 = backend.stats() if todo else {}

        def on_done(req, c) -> None:
            row = _cache_row(req, c, backend)
            if c.ok:
                writer.add({k: v for k, v in row.items() if k != "error"})
            with self._lock:
                if c.ok:
                    prog.generated += 1
                    prog.prompt_tokens += c.prompt_tokens or 0
                    prog.completion_tokens += c.completion_tokens or 0
                else:
                    prog.failed += 1
                    prog.failed_rows[req.key] = row
                prog.seconds = time.perf_counter() - t0  # generation up to this answer: the shard's one clock

        writer = gc.writer()
        try:
            if todo:
                backend.run(todo, sampling, on_done)
        finally:
            writer.close()  # one Parquet file of the cache for this shard
            if journal is not None:
                client.journal = None
                journal.close()  # the attempt ended here: its usage is in the summary
        with self._lock:
            # the shard's seconds are those its progress reported at its last answer, one clock for the polls and the
            # summary: the driver charges the budget the difference between them, which must be nothing once every
            # answer was polled (the budget's final charge is made once)
            if todo and not (prog.generated or prog.failed):
                prog.seconds = (backend.generate_s - g0) if g0 is not None else time.perf_counter() - t0
            prog.backend_stats = _stats_delta(s0, backend.stats()) if todo else {}
            prog.done = True
            self._current = None
        return asdict(prog)


def _stats_delta(before: dict, after: dict) -> dict:
    """This shard's share of a backend's cumulative counters (numbers, and dicts of numbers); others as after."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and isinstance(b, int | float):
            out[k] = v - b
        elif isinstance(v, dict) and isinstance(b, dict):
            out[k] = {kk: vv - b.get(kk, 0) if isinstance(vv, int | float) else vv for kk, vv in v.items()}
        else:
            out[k] = v
    return out


def worker_class(num_cpus: float, num_gpus: float):
    """:class:`GenerationWorker` as a Ray actor class reserving ``num_cpus``/``num_gpus`` (two threads: a
    shard runs while the driver asks for its progress)."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=2, max_restarts=0)(GenerationWorker)
