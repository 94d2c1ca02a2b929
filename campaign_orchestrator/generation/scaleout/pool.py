"""The driver side: a Ray session for the stage, and an actor pool that runs shards with retries.

:func:`ray_session` connects to ``execution.ray_address`` or starts a local cluster with this machine's
CPUs (and stops it afterwards); inside a running Ray job (a KubeRay ``RayJob``) it uses the job's connection.

:class:`ShardPool` keeps ``replicas`` workers busy with shards (``ray.wait``), polls the running shards'
progress every ``poll_s`` (each new generation's tokens and seconds go to ``on_usage``: the budget guard
sees the sum across workers), and hands each finished shard to ``on_shard``. A shard lost with its worker
(actor or node died) is run again on a fresh worker after the dead worker's spool is sealed into the cache
(``before_retry``), at most ``max_shard_retries`` times; an engine error (a rejected key, no model) fails the
stage. Either failure names the shard, the worker (node, actor, pid) and the reason (:class:`ShardFailed`).
When ``on_usage`` raises (a budget stop), every worker is killed and the error propagates: what the workers
finished is in the cache.

**Every paid answer is billed, and none twice.** A worker writes each answer to its spool as it finishes, with its
token counts, and keeps a usage journal of its running shard (``journal.py``): each request before it is sent, with
its upper bound, and each answer as it is received, before it is handed on. When a worker is lost, the pool waits
for its process to be gone (on this machine), seals its spool into the cache itself and bills the lost attempt from
its journal: every answer it received from its usage, every request in flight at the loss at its upper bound
(paid-unverified: its answer never arrived, so its usage is unknown). What is new since the last progress poll goes
to ``on_usage`` at once (the budget sees it), and all of it is added to the shard's summary when the shard finally
finishes, so the shard's cost lines include what its lost attempts were paid for. The retry looks the shard's keys
up and asks only what the cache still lacks: a spooled answer is billed by the attempt whose spool holds it, and an
answer that was received but not spooled, or in flight, is asked (and paid) again, so the ledger is never below
what was served.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


class ShardFailed(RuntimeError):
    """A shard could not be finished: ``shard`` (id), ``worker`` (where it ran), ``reason``."""

    def __init__(self, shard: str, worker: dict, reason: str, attempts: int):
        self.shard, self.worker, self.reason, self.attempts = shard, worker, reason, attempts
        super().__init__(
            f"shard {shard} failed on worker {describe_worker(worker)} after {attempts} attempt(s): {reason}"
        )


def describe_worker(w: dict | None) -> str:
    if not w:
        return "(not started)"
    node = w.get("node_ip") or w.get("host", "?")
    nid, aid = (w.get("node_id") or "")[:8], (w.get("actor_id") or "")[:8]
    return f"node {node}{f' ({nid})' if nid else ''} actor {aid or '?'} pid {w.get('pid', '?')}"


_SESSION: dict = {}  # the pools of the ray_session this process opened (closed with it)


def session_pool(execution, log: Callable[[str], None] = print) -> tuple[ShardPool, bool]:
    """A pool for ``execution`` (``replicas``, CPUs/GPUs per replica): the open :func:`ray_session`'s (kept for the
    stage's next models) and False, or a new one the caller closes and True."""
    key = (
        execution.replicas,
        execution.num_cpus_per_replica,
        execution.num_gpus_per_replica,
        execution.max_shard_retries,
    )
    pools = _SESSION.get("pools")
    if pools is not None and key in pools:
        pools[key].log = log
        return pools[key], False
    pool = ShardPool(
        replicas=execution.replicas,
        num_cpus=execution.num_cpus_per_replica,
        num_gpus=execution.num_gpus_per_replica,
        max_shard_retries=execution.max_shard_retries,
        log=log,
    )
    if pools is not None:
        pools[key] = pool
        return pool, False
    return pool, True


@contextmanager
def ray_session(ray_address: str | None = None, num_cpus: int | None = None, log: Callable[[str], None] = print):
    """Connected to Ray for the ``with`` block: an existing connection as is, ``ray_address`` when set, else a
    local cluster of ``num_cpus`` (default: this machine's) started here and stopped on exit."""
    import ray

    if ray.is_initialized():
        yield {"address": "(already connected)", "started": False}
        return
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}}
    if ray_address:
        ray.init(address=ray_address, runtime_env=env, log_to_driver=False)
        log(f"ray: connected to the cluster at {ray_address}")
        started = False
    else:
        n = num_cpus or os.cpu_count() or 1
        # address "local": a new cluster even when another one runs on this machine (`ray start`, RAY_ADDRESS)
        ray.init(address="local", num_cpus=n, include_dashboard=False, runtime_env=env, log_to_driver=False)
        log(f"ray: started a local cluster with {n} CPUs")
        started = True
    _SESSION["pools"] = {}
    try:
        yield {"address": ray_address or "local", "started": started}
    finally:
        for pool in _SESSION.pop("pools", {}).values():
            pool.close()
        ray.shutdown()
        if started:
            log("ray: local cluster stopped")


@dataclass
class _Running:
    shard: object
    attempt: int
    worker: object
    where: dict
    seen: dict = field(
        default_factory=lambda: {
            "generated": 0,
            "failed": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "seconds": 0.0,
        }
    )


def _alive(pid: int) -> bool:
    """Whether the process still holds its files (a spool's lock among them). A zombie leader is not enough: when a
    multi-threaded process is killed its leader thread may turn zombie while the other threads are still exiting
    with the process's files open, a window a loaded host stretches
    (tests/campaign_orchestrator/generation/scaleout/test_pool.py). So on Linux the process is gone once every
    thread of it is a zombie or gone."""
    import psutil

    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return True
    except psutil.Error:
        return False
    tasks = Path(f"/proc/{pid}/task")
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return False
    for t in threads:
        try:
            state = (t / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # that thread is gone
        if state not in ("Z", "X"):
            return True
    return False


def _wait_gone(where: dict, timeout_s: float) -> None:
    """Wait until a killed worker's process (on this machine) has exited, so its spool's lock is free."""
    if where.get("host") != os.uname().nodename or not where.get("pid"):
        return
    deadline = time.monotonic() + timeout_s
    while _alive(where["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)


USAGE = ("generated", "prompt_tokens", "completion_tokens", "seconds")
# a lost attempt's requests in flight, billed at their upper bound (journal.py): paid, usage unknown
UNVERIFIED = ("unverified_requests", "unverified_prompt_tokens", "unverified_completion_tokens")


def _lost(e: BaseException) -> bool:
    """The worker is gone (actor died, node lost), as opposed to the engine raising inside it."""
    import ray.exceptions as rx

    lost = tuple(
        c
        for c in (
            getattr(rx, n, None)
            for n in (
                "RayActorError",
                "ActorDiedError",
                "ActorUnavailableError",
                "WorkerCrashedError",
                "NodeDiedError",
                "ObjectLostError",
                "OwnerDiedError",
                "LocalRayletDiedError",
                "OutOfMemoryError",
            )
        )
        if c is not None
    )
    return isinstance(e, lost) and not isinstance(e, rx.RayTaskError)


class ShardPool:
    """``replicas`` workers, each reserving ``num_cpus``/``num_gpus``; :meth:`run` gives them shards of one recipe
    (a pool serves the recipes of a stage one after the other: the evaluation's candidate, base and teacher)."""

    def __init__(
        self,
        *,
        replicas: int,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        max_shard_retries: int = 3,
        job_id: str | None = None,
        poll_s: float = 0.25,
        start_timeout_s: float = 900.0,
        gone_timeout_s: float = 30.0,
        log: Callable[[str], None] = print,
    ):
        self.replicas, self.num_cpus, self.num_gpus = replicas, num_cpus, num_gpus
        self.max_shard_retries, self.poll_s, self.log = max_shard_retries, poll_s, log
        self.job_id = job_id or uuid.uuid4().hex[:12]
        self.workers: list = []
        self.where: dict = {}  # worker -> its where() (node, actor, pid)
        self._starting: dict = {}  # ready() ref -> (worker, when it was started)
        self._idle: deque = deque()
        self.start_timeout_s, self.gone_timeout_s = start_timeout_s, gone_timeout_s
        self.lost_workers: list[dict] = []  # of this pool's last run
        self.retried: list[dict] = []
        self._cls = None

    # ------------------------------------------------------------------ workers
    def _start_worker(self):
        """A new worker; it joins the idle ones once its engine is built (``ready``): a replacement Ray
        cannot place (a lost node's CPUs) never holds a shard."""
        from campaign_orchestrator.generation.scaleout.worker import worker_class

        if self._cls is None:
            self._cls = worker_class(self.num_cpus, self.num_gpus)
        threads = max(1, int(self.num_cpus))
        w = self._cls.remote(threads)
        self.workers.append(w)
        self._starting[w.ready.remote()] = (w, time.monotonic())
        return w

    def _drop(self, w) -> None:
        import ray

        try:
            ray.kill(w, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if w in self.workers:
            self.workers.remove(w)

    def close(self, wait_s: float = 30.0) -> None:
        """Kill every worker and wait (up to ``wait_s``) until Ray reports them dead: their processes are gone and
        their spools unlocked, so the driver (or the next run) can seal what they finished into the cache."""
        import ray

        workers = list(self.workers)
        for w in workers:
            self._drop(w)
        self._starting.clear()
        if workers and wait_s > 0:
            probes = [w.ready.remote() for w in workers]
            ray.wait(probes, num_returns=len(probes), timeout=wait_s)
            # Ray may report an actor dead before its process has exited (and released its spool's lock): wait for
            # the processes on this machine too

            host = os.uname().nodename
            pids = [self.where[w]["pid"] for w in workers if self.where.get(w, {}).get("host") == host]
            deadline = time.monotonic() + wait_s
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if _alive(p)]
                if pids:
                    time.sleep(0.05)

    # ------------------------------------------------------------------ shards
    def _bill_lost(self, r: _Running, where: dict, cache, paid: dict, usage_delta, on_usage) -> None:
        """Bill a lost attempt and seal its worker's spool into the cache (the retry then finds those rows cached and
        does not ask, or bill, them again). From the attempt's usage journal (``journal.py``) when the worker's node
        is this machine: every answer it received, from its usage (verified), and every request in flight at the
        loss at its upper bound (paid-unverified); else from the spool's rows. What is new since the last progress
        poll goes to ``on_usage`` at once (through ``usage_delta`` for the answers), all of it to ``paid[shard]``
        for the shard's summary. Answers counted as done (``generated``) are the spooled ones: the others are
        asked again by the retry."""
        spool = where.get("spool")
        if not spool:
            return
        _wait_gone(where, self.gone_timeout_s)
        got = {"generated": 0, "prompt_tokens": 0, "completion_tokens": 0}

        def count(rows: list[dict]) -> None:
            got["generated"] += len(rows)
            got["prompt_tokens"] += sum(int(x.get("prompt_tokens") or 0) for x in rows)
            got["completion_tokens"] += sum(int(x.get("completion_tokens") or 0) for x in rows)

        try:
            cache.recover(spool, on_rows=count)
        except Exception as e:  # noqa: BLE001 - the rows stay in the spool; the stage's final recovery seals them
            self.log(
                f"shard {r.shard.id}: sealing the lost worker's spool failed ({e}); its answers are sealed "
                "at the end of the stage"
            )
            return
        tally = None
        if where.get("host") == os.uname().nodename:
            from campaign_orchestrator.generation.scaleout.journal import journal_path, read_journal

            path = journal_path(cache.spool_dir, spool, r.shard.id, r.attempt)
            tally = read_journal(path)
        if tally is not None:  # every answer received was billed, spooled or not
            got["prompt_tokens"] = max(got["prompt_tokens"], tally.prompt_tokens)
            got["completion_tokens"] = max(got["completion_tokens"], tally.completion_tokens)
        seen = dict(r.seen)
        usage_delta(r, {**seen, **{k: max(seen[k], got[k]) for k in got}})
        carry = paid.setdefault(r.shard.id, dict.fromkeys(USAGE + UNVERIFIED, 0))
        for k in got:
            carry[k] += got[k]
        carry["seconds"] += seen["seconds"]  # its generation time up to the last poll
        if tally is not None and tally.in_flight:
            carry["unverified_requests"] += tally.in_flight
            carry["unverified_prompt_tokens"] += tally.bound_prompt_tokens
            carry["unverified_completion_tokens"] += tally.bound_completion_tokens
            if on_usage is not None:  # the budget sees what they may have cost; none is answered (the retry asks)
                on_usage(
                    {
                        "generated": 0,
                        "failed": 0,
                        "prompt_tokens": tally.bound_prompt_tokens,
                        "completion_tokens": tally.bound_completion_tokens,
                        "seconds": 0.0,
                    }
                )
        if tally is not None and (tally.in_flight or tally.answers > got["generated"]):
            self.log(
                f"shard {r.shard.id}: the lost worker had {tally.answers - got['generated']} answer(s) received and "
                f"not in the cache (billed from their usage) and {tally.in_flight} request(s) in flight (billed as "
                f"paid-unverified at their upper bound: {tally.bound_prompt_tokens} prompt + "
                f"{tally.bound_completion_tokens} completion tokens); the retry asks them again"
            )
        if tally is not None:
            path.unlink(missing_ok=True)

    def run(
        self,
        recipe,
        cache,
        shards: list,
        sampling,
        *,
        limits: str | None = None,
        on_usage: Callable[[dict], None] | None = None,
        on_shard: Callable[[dict], None] | None = None,
        before_retry: Callable[[object, dict], None] | None = None,
    ) -> dict[str, dict]:
        """Run every shard with ``recipe``'s engine into ``cache`` (a
        :class:`~campaign_orchestrator.generation.scaleout.worker.
        CacheConfig`; ``limits``: the name of the job's shared rate limits); returns ``{key: row}`` of the requests that
        failed (errors are never cached).
        ``on_usage(delta)``: new generations' ``generated``, ``failed``, ``prompt_tokens``,
        ``completion_tokens``, ``seconds`` since the last call (any worker); ``on_shard(summary)`` per finished
        shard (``summary``: the worker's :class:`ShardProgress` plus ``worker``); ``before_retry(shard, worker)`` runs
        before a lost shard is submitted again (the driver seals the dead worker's spool there)."""
        import ray

        self.lost_workers, self.retried = [], []
        queue = deque((s, 1) for s in shards)
        running: dict = {}
        failed_rows: dict[str, dict] = {}
        paid: dict[str, dict] = {}  # shard id -> usage its lost attempts answered (from their sealed spools)
        want = min(self.replicas, len(shards))
        while len(self.workers) < want:
            self._start_worker()

        def usage_delta(r: _Running, p: dict) -> None:
            if on_usage is None or not p:
                return
            delta = {k: p[k] - r.seen[k] for k in r.seen}
            if any(delta.values()):
                r.seen = {k: p[k] for k in r.seen}
                on_usage(delta)

        def reason_of(e: BaseException) -> str:
            text = str(e).strip()
            return f"{type(e).__name__}: {text.splitlines()[-1][:300] if text else ''}"

        try:
            while queue or running:
                while self._idle and queue:
                    w = self._idle.popleft()
                    shard, attempt = queue.popleft()
                    ref = w.run_shard.remote(recipe, cache, shard.id, attempt, shard.requests, sampling, limits)
                    running[ref] = _Running(shard, attempt, w, self.where.get(w, {}))
                if not running and not self._starting:
                    raise ShardFailed(queue[0][0].id, {}, "no worker left to run it", queue[0][1])
                if not running and all(time.monotonic() - t > self.start_timeout_s for _, t in self._starting.values()):
                    raise ShardFailed(
                        queue[0][0].id,
                        {},
                        f"no worker could be placed on the cluster within "
                        f"{self.start_timeout_s:.0f} s ({self.num_cpus} CPUs, {self.num_gpus} GPUs "
                        f"per replica)",
                        queue[0][1],
                    )
                ready, _ = ray.wait(list(running) + list(self._starting), num_returns=1, timeout=self.poll_s)
                for ref in ready:
                    if ref in self._starting:
                        w, _t = self._starting.pop(ref)
                        try:
                            self.where[w] = ray.get(ref)
                        except Exception as e:  # noqa: BLE001
                            self._drop(w)
                            if not _lost(e):  # the engine cannot be built: no retry helps
                                raise ShardFailed(
                                    queue[0][0].id if queue else "-",
                                    {},
                                    f"the worker could not build its engine: {reason_of(e)}",
                                    0,
                                ) from e
                            self.lost_workers.append({"shard": None, "worker": {}, "reason": reason_of(e)})
                            if len(self.lost_workers) > self.max_shard_retries + want:
                                raise ShardFailed(
                                    queue[0][0].id if queue else "-",
                                    {},
                                    f"workers keep dying before they start: {reason_of(e)}",
                                    0,
                                ) from e
                            self._start_worker()
                            continue
                        self._idle.append(w)
                        continue
                    r = running.pop(ref)
                    where = self.where.get(r.worker, {})
                    try:
                        summary = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - sorted below: lost worker or engine error
                        reason = reason_of(e)
                        if not _lost(e):
                            raise ShardFailed(r.shard.id, where, reason, r.attempt) from e
                        self.lost_workers.append({"shard": r.shard.id, "worker": where, "reason": reason})
                        self.log(
                            f"shard {r.shard.id} lost with worker {describe_worker(where)} ({reason}); "
                            f"attempt {r.attempt} of {self.max_shard_retries + 1}"
                        )
                        self._drop(r.worker)
                        self._bill_lost(r, where, cache, paid, usage_delta, on_usage)
                        if r.attempt > self.max_shard_retries:
                            raise ShardFailed(r.shard.id, where, reason, r.attempt) from e
                        if before_retry is not None:
                            before_retry(r.shard, where)
                        self.retried.append({"shard": r.shard.id, "attempt": r.attempt + 1})
                        queue.appendleft((r.shard, r.attempt + 1))
                        if len(self.workers) < want:
                            self._start_worker()
                        continue
                    usage_delta(r, summary)
                    for k, v in paid.pop(r.shard.id, {}).items():  # what its lost attempts answered (and paid for)
                        summary[k] = summary.get(k, 0) + v
                    failed_rows.update(summary.pop("failed_rows", {}) or {})
                    if on_shard is not None:
                        on_shard(summary | {"worker": where, "requests": len(r.shard)})
                    self._idle.append(r.worker)
                if running and on_usage is not None:  # what the running shards have paid for so far
                    items = list(running.values())
                    refs = [x.worker.progress.remote() for x in items]
                    try:
                        progress = ray.get(refs, timeout=max(1.0, 4 * self.poll_s))
                    except Exception:  # noqa: BLE001 - a dying worker: its shard's ref reports it
                        progress = [None] * len(items)
                    for x, p in zip(items, progress, strict=True):
                        if p and p["shard"] == x.shard.id and p["attempt"] == x.attempt:
                            usage_delta(x, p)
        except BaseException:
            self.close()  # a budget stop or a failed shard stops every worker; the cache keeps what finished
            raise
        return failed_rows
