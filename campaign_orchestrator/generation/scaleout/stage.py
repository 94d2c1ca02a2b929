"""A generation stage on Ray: :class:`RayExecutor` is :func:`campaign_orchestrator.generation.runner.run_generation`'s
executor on a sharded actor pool (the local one is :class:`~campaign_orchestrator.generation.runner.LocalExecutor`);
same rows, same statistics, same cache, same billed usage.

1. ``run_generation`` builds the requests and their keys, seals spools a killed run left (every worker's too)
   and looks every key up in the cache.
2. The executor cuts *all* distinct requests into shards by content (:mod:`.shards`): the same prompts give the
   same shards, whatever is cached. A shard whose keys are all cached is done ($0); the others go to the pool,
   which asks only their missing keys.
3. Workers write each finished generation to the cache as it finishes (their own spools), one Parquet file
   per shard; the driver charges the budget guard with every worker's new usage as it is polled, and reports
   each finished shard (:class:`ShardReport`: id, worker, requests, tokens, seconds, dollars).
4. The rows are read back from the cache in prompt order (errors, never cached, come from the workers).

:func:`run_on_ray` runs it inside a :func:`ray_session`; :func:`run_job` is the same inside a KubeRay ``RayJob``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields

from campaign_orchestrator.generation.requests import Sampling
from campaign_orchestrator.generation.runner import GenerationResult, GenerationStats, run_generation
from campaign_orchestrator.generation.scaleout.pool import ShardPool, describe_worker, ray_session
from campaign_orchestrator.generation.scaleout.shards import make_shards
from campaign_orchestrator.generation.scaleout.worker import CacheConfig


@dataclass
class ShardReport:
    """What one shard did in this run (a cached shard: ``cached`` only, $0)."""

    id: str
    index: int
    requests: int
    cached: int = 0
    generated: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    usd: float | None = 0.0  # None: unpriced
    lines: list | None = None  # its cost lines as the ledger records them (None: unpriced)
    worker: str = ""
    attempts: int = 0
    # requests in flight when a worker running the shard was lost (scaleout/journal.py): paid, usage unknown, billed
    # at their upper bound in lines marked ``verified: false`` (their dollars: ``unverified_usd``, inside ``usd``)
    unverified_requests: int = 0
    unverified_prompt_tokens: int = 0
    unverified_completion_tokens: int = 0
    unverified_usd: float = 0.0


@dataclass
class RayRun:
    """What the pool did: per-shard reports, lost workers and retries (the asset's metadata)."""

    shards: list[ShardReport] = field(default_factory=list)
    lost_workers: list[dict] = field(default_factory=list)
    retried: list[dict] = field(default_factory=list)
    nodes: dict = field(default_factory=dict)  # "<node ip> <node id[:8]>" -> shards finished there
    wall_s: float = 0.0

    @property
    def done(self) -> int:
        return sum(1 for s in self.shards if s.attempts or not (s.requests - s.cached))

    def as_dict(self) -> dict:
        return {
            "shards_total": len(self.shards),
            "shards_done": self.done,
            "shards_cached": sum(1 for s in self.shards if not s.attempts),
            "lost_workers": self.lost_workers,
            "retried": self.retried,
            "nodes": self.nodes,
            "wall_s": self.wall_s,
            "shards": [asdict(s) for s in self.shards],
        }

    @classmethod
    def from_dict(cls, d: dict) -> RayRun:
        """The run a job's summary describes (``as_dict``, as ``python -m campaign_orchestrator.generation.scaleout
        --summary``
        writes it under ``ray``)."""
        known = {f.name for f in fields(ShardReport)}
        return cls(
            shards=[ShardReport(**{k: v for k, v in s.items() if k in known}) for s in d.get("shards", [])],
            lost_workers=list(d.get("lost_workers", [])),
            retried=list(d.get("retried", [])),
            nodes=dict(d.get("nodes", {})),
            wall_s=float(d.get("wall_s", 0.0)),
        )


def stats_from_dict(d: dict) -> GenerationStats:
    """The :class:`GenerationStats` of ``GenerationStats.as_dict()`` (a job summary's ``stats``)."""
    known = {f.name for f in fields(GenerationStats)}
    return GenerationStats(**{k: v for k, v in d.items() if k in known})


def price_shard(rep: ShardReport, price: Callable[[dict], list | None] | None) -> None:
    """Price a finished shard's usage (``price(usage)``: its cost lines, None when unpriced); a shard that asked
    nothing (found in the cache meanwhile) costs nothing. Requests in flight when a worker was lost are priced at
    their upper bound on lines of their own, marked ``verified: false`` (paid, usage unknown); where the price is
    by time (a local model) their time is in the attempt's seconds already."""
    if price is not None and (rep.generated or rep.failed or rep.unverified_requests):
        rep.lines = price(
            {"seconds": rep.seconds, "prompt_tokens": rep.prompt_tokens, "completion_tokens": rep.completion_tokens}
        )
        if rep.lines is not None and rep.unverified_requests:
            bound = price(
                {
                    "seconds": 0.0,
                    "prompt_tokens": rep.unverified_prompt_tokens,
                    "completion_tokens": rep.unverified_completion_tokens,
                }
            )
            unverified = [x | {"verified": False} for x in bound or [] if x["usd"]]
            rep.lines = None if bound is None else rep.lines + unverified
            rep.unverified_usd = float(sum(x["usd"] for x in unverified))
        rep.usd = None if rep.lines is None else float(sum(x["usd"] for x in rep.lines))


def worth_a_line(rep: ShardReport, run: RayRun) -> bool:
    """Whether a finished shard gets a line in the run log: at most ~50 per stage, the last one, and every
    retried or failing shard."""
    total = len(run.shards)
    every = max(1, total // 50)
    return not (run.done % every and run.done != total and rep.attempts < 2 and not rep.failed)


class RayExecutor:
    """:func:`campaign_orchestrator.generation.runner.run_generation`'s executor on a Ray actor pool (needs a Ray
    connection: :func:`ray_session`). ``recipe`` builds the engine in each worker; ``identity`` is the engine's
    identity (every request key hashes it); ``cache_config`` the cache the workers write (the driver's
    ``cache`` is ``cache_config.open()``); ``execution`` the ``execution:`` section. ``price(usage)`` gives the cost
    lines of a shard's usage (``seconds``, ``prompt_tokens``, ``completion_tokens``; None: unknown); ``on_shard``
    sees each finished shard; ``pool``: reuse a running pool (else the session's, or one made and closed here).
    After a run, :attr:`run` is what the pool did (per-shard reports, lost workers, retries)."""

    answered_by = "the Ray workers"

    def __init__(
        self,
        recipe,
        identity: str,
        cache_config: CacheConfig,
        execution,
        *,
        price: Callable[[dict], list | None] | None = None,
        on_shard: Callable[[ShardReport, RayRun], None] | None = None,
        rate_limits: tuple[float | None, float | None] = (None, None),
        pool: ShardPool | None = None,
    ):
        self.recipe, self.identity, self.cache_config, self.execution = recipe, identity, cache_config, execution
        self.price, self.on_shard, self.rate_limits, self.pool = price, on_shard, rate_limits, pool
        self.run = RayRun()
        self._shards: list = []

    def recover(self) -> int:
        """No worker of this run is writing yet: every worker's spool a killed run left is sealed too."""
        return self.cache_config.recover()

    def prepare(self, work) -> str:
        """*All* distinct requests cut into shards by content (:mod:`.shards`): the same prompts give the same
        shards, whatever is cached; a shard whose keys are all cached is done ($0)."""
        st, ex = work.stats, self.execution
        self._shards = make_shards([r for rs in work.reqs for r in rs], ex.shard_prompts)
        self.run = RayRun(
            shards=[
                ShardReport(s.id, s.index, len(s), cached=sum(k in work.found for k in s.keys)) for s in self._shards
            ]
        )
        todo = sum(1 for rep in self.run.shards if rep.cached < rep.requests)
        return (
            f"{st.requests} requests ({st.distinct_requests} distinct) in {len(self._shards)} shards of up to "
            f"{ex.shard_prompts}: {st.cache_hits} cache hits ($0), {len(self._shards) - todo} shards complete, "
            f"{len(work.missing)} requests in {todo} shards to generate on {min(ex.replicas, todo)} Ray workers"
        )

    def execute(self, work) -> dict[str, dict]:
        """The shards the cache lacks on the pool (which asks only their missing keys); the budget is charged with
        every worker's new usage as it is polled, each finished shard priced and reported. The rows are read back
        from the cache (errors, never cached, come from the workers)."""
        run, st, cache, cfg, per_key, budget = (
            self.run,
            work.stats,
            work.cache,
            self.cache_config,
            work.per_key,
            work.budget,
        )
        todo = [s for s, rep in zip(self._shards, run.shards, strict=True) if rep.cached < rep.requests]
        missing = len(work.missing)
        by_id = {r.id: r for r in run.shards}
        new_rows = {s.id: sum(per_key[k] for k in s.keys if k not in work.found) for s in todo}  # progress per shard
        answered = 0
        t_gen = time.perf_counter()

        def on_usage(d: dict) -> None:
            nonlocal answered
            answered += d["generated"] + d["failed"]
            if budget is not None:
                budget.charge(
                    items=d["generated"] + d["failed"],
                    prompt_tokens=d["prompt_tokens"],
                    completion_tokens=d["completion_tokens"],
                    seconds=d["seconds"],
                    final=answered >= missing,
                )

        def shard_done(summary: dict) -> None:
            rep = by_id[summary["shard"]]
            rep.generated, rep.failed = summary["generated"], summary["failed"]
            rep.prompt_tokens, rep.completion_tokens = summary["prompt_tokens"], summary["completion_tokens"]
            rep.seconds, rep.attempts = summary["seconds"], summary["attempt"]
            rep.unverified_requests = summary.get("unverified_requests", 0)
            rep.unverified_prompt_tokens = summary.get("unverified_prompt_tokens", 0)
            rep.unverified_completion_tokens = summary.get("unverified_completion_tokens", 0)
            rep.worker = describe_worker(summary["worker"])
            w = summary["worker"]
            node = f"{w.get('node_ip') or w.get('host', '?')} {(w.get('node_id') or '')[:8]}".strip()
            run.nodes[node] = run.nodes.get(node, 0) + 1
            price_shard(rep, self.price)
            bs = summary.get("backend_stats") or {}
            st.http_requests += bs.get("http_requests", 0)
            for k, v in (bs.get("retry_reasons") or {}).items():
                st.retry_reasons[k] = st.retry_reasons.get(k, 0) + v
            st.compute_dtype = bs.get("compute_dtype") or st.compute_dtype
            st.generate_s += rep.seconds
            if work.progress:
                work.progress(new_rows.pop(rep.id, 0))
            if self.on_shard is not None:
                self.on_shard(rep, run)

        failed_rows = self._run_pool(todo, work, on_usage, shard_done) if todo else {}
        run.wall_s = time.perf_counter() - t_gen
        cfg.recover()  # every worker is done: seal what any of them left
        results = cache.lookup(per_key)
        results |= {k: v for k, v in failed_rows.items() if k not in results}
        # paid in this run: what the cache lacked at the start and was answered since (a lost worker's finished part
        # included); rows a killed earlier run left in a spool that a worker sealed meanwhile are cache hits ($0)
        found = work.found
        late = {
            k
            for k in per_key
            if k not in found and k in results and (results[k].get("created_at") or work.started_at) < work.started_at
        }
        st.cache_hits += len(late)
        found.update({k: results[k] for k in late})
        new = [results[k] for k in per_key if k not in found and k in results]
        st.generated = sum(1 for c in new if not c.get("error"))
        st.failed = sum(1 for c in new if c.get("error"))
        st.new_prompt_tokens = sum(c["prompt_tokens"] or 0 for c in new if not c.get("error"))
        st.new_completion_tokens = sum(c["completion_tokens"] or 0 for c in new if not c.get("error"))
        return results

    def _run_pool(self, todo: list, work, on_usage, shard_done) -> dict[str, dict]:
        """The shards on the pool under the job's rate limits; on any stop (a budget stop, a failed shard) what the
        stopped workers finished is sealed into the cache before the error propagates."""
        import uuid

        from campaign_orchestrator.generation.scaleout.pool import session_pool
        from campaign_orchestrator.generation.scaleout.ratelimit import start_limits

        cfg, pool, own = self.cache_config, self.pool, False
        if pool is None:
            pool, own = session_pool(self.execution, work.log)
        limits_id = uuid.uuid4().hex[:12]
        limits = start_limits(limits_id, *self.rate_limits)
        try:
            failed_rows = pool.run(
                self.recipe,
                cfg,
                todo,
                work.sampling,
                limits=limits_id if limits else None,
                on_usage=on_usage,
                on_shard=shard_done,
                before_retry=lambda _s, w: cfg.recover(w.get("spool") or None) if w.get("spool") else 0,
            )
        except BaseException:  # a budget stop, a failed shard: what the stopped workers finished goes to the cache
            try:
                work.log(
                    f"generation stopped; {cfg.recover()} answers the stopped workers finished are sealed into "
                    f"the cache ({work.cache.store.url}); a re-run continues from there"
                )
            except Exception as e:  # noqa: BLE001 - keep the original error; the spools stay for the next run
                work.log(f"generation stopped, and sealing the workers' spools failed too ({e})")
            raise
        finally:
            if own:
                pool.close()
            if limits is not None:
                import ray

                ray.kill(limits)
        self.run.lost_workers, self.run.retried = pool.lost_workers, pool.retried
        return failed_rows


def run_job(job, log: Callable[[str], None] = print, on_shard=None, budget=None) -> tuple[GenerationResult, RayRun]:
    """Run a :class:`~campaign_orchestrator.generation.scaleout.job.Job` on the connected Ray cluster and write its
    rows to ``job.output`` (the entry point a KubeRay ``RayJob`` runs; the Dagster step runs the same code).
    ``budget``: what :func:`~campaign_orchestrator.generation.runner.run_generation` asks of a guard
    (``check_planned``, ``charge``)."""
    from types import SimpleNamespace

    from campaign_orchestrator.dataset.prompts import read_prompt_table
    from campaign_orchestrator.generation.rows import write_generations

    cfg = CacheConfig(**job.cache)
    cache = cfg.open()
    sampling = Sampling(**job.sampling)
    execution = SimpleNamespace(**job.execution)
    rows = read_prompt_table(job.prompts)
    spec = getattr(job.recipe, "spec", None)
    limits = (
        (spec.requests_per_minute, spec.tokens_per_minute)
        if spec is not None and spec.backend == "openai"
        else (None, None)
    )
    ex = RayExecutor(job.recipe, job.identity, cfg, execution, on_shard=on_shard, rate_limits=limits)
    res = run_generation(
        rows,
        ex,
        sampling,
        cache,
        chat=job.chat,
        context=job.context,
        context_categories=job.context_categories,
        log=log,
        budget=budget,
    )
    write_generations(res.rows, job.output)
    return res, ex.run


def _usd(x: float | None) -> str:
    return "$ unknown (unpriced)" if x is None else f"${x:.6f}"


class KubeRayNotLaunched(RuntimeError):
    """``run_on_ray`` was asked to run a stage whose campaign sets ``execution.kuberay``."""


def refuse_unlaunched_kuberay(execution) -> None:
    """Refuse ``execution.kuberay`` here: this module runs Ray where its process is (a local cluster or
    ``execution.ray_address``). A stage with ``execution.kuberay`` is launched as a KubeRay RayJob by its Dagster
    asset (the stage's executor, ``stages/executors.py``), whose driver runs :func:`run_job` inside the cluster;
    running it on a local cluster instead would not be what the campaign asked for."""
    if getattr(execution, "kuberay", None) is not None:
        raise KubeRayNotLaunched(
            "execution.kuberay: this stage runs as a KubeRay RayJob launched by its Dagster asset "
            "(stages/executors.py: the `kuberay` resource), not on a Ray cluster where this process is; to use a "
            "running cluster from here, remove execution.kuberay and set execution.ray_address"
        )


def run_on_ray(
    execution,
    prompts: Sequence[dict],
    recipe,
    identity: str,
    sampling: Sampling,
    cache_config: CacheConfig,
    *,
    log: Callable[[str], None],
    label: str = "generations",
    chat: bool = False,
    context: Sequence[dict] = (),
    context_categories: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    budget=None,
    price: Callable[[dict], list | None] | None = None,
    on_shard: Callable[[ShardReport, RayRun], None] | None = None,
    rate_limits: tuple[float | None, float | None] = (None, None),
    pool: ShardPool | None = None,
) -> tuple[GenerationResult, RayRun]:
    """:func:`~campaign_orchestrator.generation.runner.run_generation` with a :class:`RayExecutor` inside a
    :func:`ray_session` for ``execution`` (a local cluster the stage starts and stops, or ``execution.ray_address``),
    logging each finished shard: shards done/total, the worker, tokens/s and dollars so far (the stage's progress
    in the Dagster run log). Returns the result and what the pool did."""
    refuse_unlaunched_kuberay(execution)
    t0 = time.perf_counter()
    user_on_shard = on_shard

    def logged(rep: ShardReport, run: RayRun) -> None:
        if user_on_shard is not None:
            user_on_shard(rep, run)
        if not worth_a_line(rep, run):
            return
        el = max(1e-9, time.perf_counter() - t0)
        tokens = sum(r.completion_tokens for r in run.shards)
        paid = [r.usd for r in run.shards if r.attempts]
        usd = None if any(u is None for u in paid) else sum(paid)
        log(
            f"{label}: shard {rep.id} done ({run.done}/{len(run.shards)} shards) on {rep.worker}: "
            f"{rep.generated} generated, {rep.failed} failed, {rep.completion_tokens} tokens in {rep.seconds:.1f} s, "
            f"{_usd(rep.usd)}; so far {tokens / el:.1f} tokens/s, {_usd(usd)}"
        )

    ex = RayExecutor(
        recipe, identity, cache_config, execution, price=price, on_shard=logged, rate_limits=rate_limits, pool=pool
    )
    with ray_session(getattr(execution, "ray_address", None), log=log):
        res = run_generation(
            prompts,
            ex,
            sampling,
            cache_config.open(),
            chat=chat,
            context=context,
            context_categories=context_categories,
            progress=progress,
            log=log,
            budget=budget,
        )
    return res, ex.run


def shard_cost_lines(run: RayRun) -> list[dict] | None:
    """Every shard's cost lines, each tagged with its shard id (None: some shard is unpriced)."""
    out = []
    for r in run.shards:
        if r.attempts and (r.generated or r.failed):
            if r.lines is None:
                return None
            out += [x | {"shard": r.id} for x in r.lines]
    return out


def unverified_summary(run: RayRun) -> dict:
    """The run's paid-unverified share: requests in flight when a worker was lost, billed at their upper bound
    (``unverified_requests``, ``unverified_usd``, and ``unverified_share`` of the run's dollars; None: unpriced)."""
    usd = [r.usd for r in run.shards if r.attempts]
    total = None if any(u is None for u in usd) else float(sum(usd))
    unverified = float(sum(r.unverified_usd for r in run.shards))
    return {
        "unverified_requests": sum(r.unverified_requests for r in run.shards),
        "unverified_usd": unverified,
        "unverified_share": unverified / total if total else (None if total is None else 0.0),
    }


def unverified_text(ray: dict) -> str:
    """The paid-unverified share of a Ray stage (its ``ray_metadata``), for people."""
    share = ray.get("unverified_share")
    return (
        f"{ray['unverified_requests']} request(s) in flight when a worker was lost, billed at their upper bound: "
        f"${ray['unverified_usd']:.6f}" + ("" if share is None else f" ({share:.1%} of the stage's bill)")
    )


def ray_metadata(run: RayRun) -> dict:
    """The Ray side of a stage, for its manifest and asset metadata."""
    d = run.as_dict()
    tokens = sum(r.completion_tokens for r in run.shards)
    return {
        **unverified_summary(run),
        "shards_total": d["shards_total"],
        "shards_done": d["shards_done"],
        "shards_cached": d["shards_cached"],
        "shards_retried": len(run.retried),
        "lost_workers": run.lost_workers,
        "nodes": run.nodes,
        "ray_wall_seconds": run.wall_s,
        "ray_tokens_per_s": tokens / run.wall_s if run.wall_s else 0.0,
        "shards": [
            {
                "id": r.id,
                "requests": r.requests,
                "cached": r.cached,
                "generated": r.generated,
                "failed": r.failed,
                "tokens": r.prompt_tokens + r.completion_tokens,
                "seconds": round(r.seconds, 3),
                "usd": r.usd,
                "worker": r.worker,
                "attempts": r.attempts,
                **({"unverified_requests": r.unverified_requests} if r.unverified_requests else {}),
            }
            for r in run.shards
        ],
    }


def answers_on_ray(
    execution,
    prompts: Sequence[str],
    recipe,
    identity: str,
    max_new_tokens: int,
    cache_config_for: Callable[[Sampling], CacheConfig],
    *,
    log: Callable[[str], None],
    label: str,
    run: Callable | None = None,
    **kwargs,
) -> tuple[list, RayRun, GenerationStats]:
    """Greedy answers of a local model (an :class:`~campaign_orchestrator.generation.scaleout.job.AnswerFactory`) to
    ``prompts`` on Ray, in order, as ``generate(prompts, max_new_tokens)`` returns them (``text``, ``latency_s``,
    ``error``); cached under ``identity`` like teacher generations, so a lost shard costs its in-flight prompts.
    ``run``: what runs the shards, called as :func:`run_on_ray` (the default) is, with ``kwargs`` (e.g. a KubeRay
    RayJob launched by the Dagster asset)."""
    from campaign_orchestrator.generation.runner import answers

    sampling = Sampling(max_new_tokens=max_new_tokens)
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(prompts)]
    res, run = (run or run_on_ray)(
        execution, rows, recipe, identity, sampling, cache_config_for(sampling), log=log, label=label, **kwargs
    )
    return answers(res.rows), run, res.stats
