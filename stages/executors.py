"""Where a generation stage's work runs, chosen in one place (:func:`executor_for`): this process, a Ray actor pool,
or a KubeRay RayJob. The teacher stage, the teacher's scoring in evaluation and the evaluated models' answers all
ask the executor they are given the same way, and get rows, cost lines and statistics of the same shape.

- :class:`InProcess` (``execution.executor: local``): the generation loop here, through the generation cache.
- :class:`RayPool` (``execution.executor: ray`` without ``execution.kuberay``): the prompts as shards on a Ray actor
  pool (:func:`campaign_orchestrator.generation.scaleout.stage.run_on_ray`: a local cluster the stage starts and
  stops, or the cluster at ``execution.ray_address``); the workers write the same generation cache.
- :class:`KubeRayJob` (``execution.kuberay`` set): a KubeRay ``RayJob`` the stage launches through the context's
  ``kuberay`` launcher (the Dagster ``kuberay`` resource). The stage writes the prompts (Parquet) and ``ray_job.json``
  (a :class:`campaign_orchestrator.generation.scaleout.job.Job`) under its work directory on the artifact root, which
  the Ray pods mount at the same path; the job's driver runs ``python -m campaign_orchestrator.generation.scaleout``
  inside the cluster, whose finished shards are charged to the stage's budget guard as they arrive (``ray_shard``
  Pipes messages); the rows come back from the job's output Parquet, the statistics and shard reports from its
  summary, and each shard is priced here with the stage's ``price`` callback, as on a local cluster.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

from campaigns.spec import CampaignSpec
from stages.teacher import TeacherModel, ask_kwargs, teacher_usage


def executor_for(spec: CampaignSpec, stage: str, ctx, workdir: Path | None = None):
    """The executor of ``stage``'s generation work: :class:`InProcess`, :class:`RayPool` or :class:`KubeRayJob`
    (its job files under ``workdir``, launched with ``ctx.kuberay``). The one place that reads
    ``execution.executor`` and ``execution.kuberay``."""
    ex = spec.execution
    if ex.executor != "ray":
        return InProcess()
    if ex.kuberay is None:
        return RayPool(ex)
    return KubeRayJob(spec, ctx.kuberay, stage, Path(workdir) if workdir is not None else Path("."))


def cache_config(store, identity: str, sampling):
    """The generation cache as Ray workers open it (:class:`campaign_orchestrator.generation.scaleout.worker
    .CacheConfig`): the same store and namespace as this process's."""
    from campaign_orchestrator.generation.requests import namespace
    from campaign_orchestrator.generation.scaleout.worker import CacheConfig

    return CacheConfig(
        store.cache_store().url,
        namespace(identity, sampling),
        str(store.spool_dir()),
        store.s3_endpoint_url,
        store.s3_region,
    )


class InProcess:
    """Generation in this process (``execution.executor: local``)."""

    def at(self, sub: str) -> InProcess:
        return self

    def session(self, log):
        return nullcontext()

    def teacher(
        self,
        ctx,
        spec: CampaignSpec,
        backend,
        rows: list,
        sampling,
        tm: TeacherModel,
        stage: str,
        *,
        log,
        progress=None,
        budget=None,
        remote_budget=None,
        free_if_cached=False,
    ) -> tuple:
        """The teacher (``backend``) answering ``rows`` through its cache: ``(result, cost lines of the new
        generations at the teacher's price or None when unpriced, None)`` (``budget``: charged per generation;
        ``free_if_cached``: no lines at all when nothing was generated)."""
        from campaign_orchestrator.generation.runner import run_generation
        from stages.teacher import teacher_cache

        cache = teacher_cache(ctx.store, tm.identity, sampling)
        res = run_generation(
            rows, backend, sampling, cache, **ask_kwargs(spec.teacher), progress=progress, log=log, budget=budget
        )
        if free_if_cached and not res.stats.generated:
            return res, [], None
        return res, ctx.pricing.bill(spec, stage, teacher_usage(res.stats))["lines"], None

    def answerer(
        self, ctx, spec: CampaignSpec, role: str, base, adapter: dict | None, dtypes: dict | None, remote_budget=None
    ) -> Callable:
        """A factory of the local model's ``generate(prompts, max_new_tokens)`` (the student's base, or with
        ``adapter`` the candidate) answering through the generation cache under its content identity
        (:func:`stages.answers.answer_identity`): loaded only when some item is not there yet."""
        from campaign_orchestrator.generation.backends import TransformersBackend
        from campaign_orchestrator.generation.runner import cached_answers
        from evaluation.judging import tally
        from stages.answers import answer_identity, batch_size
        from stages.teacher import teacher_cache

        s, q = spec.student, spec.student.quantization
        identity, precision = answer_identity(spec, base, adapter)

        def on_stats(st):
            if dtypes is not None:
                dtypes[role] = st.compute_dtype or precision.split(":", 1)[1]
                tally(dtypes.setdefault("_answers", {}), role, st)

        def factory():  # the backend (and the model it loads) lives while its role answers, then goes
            backend = TransformersBackend(
                base,
                f"{s.base_model} ({role})",
                identity,
                batch_size=batch_size(spec),
                compute_dtype=q.compute_dtype,
                precision=precision,
                adapter_dir=adapter["adapter_path"] if adapter else None,
                load_in_4bit=q.load_in_4bit,
            )
            return cached_answers(
                backend,
                lambda sampling: teacher_cache(ctx.store, identity, sampling),
                log=ctx.log.info,
                on_stats=on_stats,
            )

        return factory


class RayPool(InProcess):
    """Shards on a Ray actor pool here or at ``execution.ray_address`` (``execution.executor: ray``)."""

    def __init__(self, execution):
        self.execution = execution

    def session(self, log):
        """One Ray session for every model a stage asks (evaluation)."""
        from campaign_orchestrator.generation.scaleout.pool import ray_session

        return ray_session(self.execution.ray_address, log=log)

    def runner(self, kind: str) -> Callable:
        """What runs the shards: :func:`run_on_ray`'s signature."""
        from campaign_orchestrator.generation.scaleout.stage import run_on_ray

        return run_on_ray

    def forwarded_budget(self, budget, remote_budget):
        return budget

    def teacher(
        self,
        ctx,
        spec: CampaignSpec,
        backend,
        rows: list,
        sampling,
        tm: TeacherModel,
        stage: str,
        *,
        log,
        progress=None,
        budget=None,
        remote_budget=None,
        free_if_cached=False,
    ) -> tuple:
        """The teacher answering ``rows`` on Ray: ``(result, cost lines per shard tagged with the shard id or None
        when unpriced, the Ray metadata)``; the workers write the same generation cache. ``stage``:
        ``teacher_generations`` or ``teacher_scoring``."""
        from campaign_orchestrator.generation.factories import BackendFactory
        from campaign_orchestrator.generation.scaleout.stage import ray_metadata, shard_cost_lines

        t = spec.teacher
        kwargs: dict[str, Any] = {"progress": progress} if progress is not None else {}
        forwarded = self.forwarded_budget(budget, remote_budget)
        if forwarded is not None:
            kwargs["budget"] = forwarded
        res, run = self.runner(stage)(
            spec.execution,
            rows,
            BackendFactory(t, str(tm.path) if tm.path else None, tm.weights_id),
            tm.identity,
            sampling,
            cache_config(ctx.store, tm.identity, sampling),
            log=log,
            label=stage.replace("_", " "),
            **ask_kwargs(t),
            price=ctx.pricing.price_fn(spec, stage),
            rate_limits=(t.requests_per_minute, t.tokens_per_minute) if t.api else (None, None),
            **kwargs,
        )
        lines = [] if free_if_cached and not res.stats.generated else shard_cost_lines(run)
        return res, lines, ray_metadata(run)

    def answerer(
        self, ctx, spec: CampaignSpec, role: str, base, adapter: dict | None, dtypes: dict | None, remote_budget=None
    ) -> Callable:
        """A factory of a ``generate(prompts, max_new_tokens)`` answering on the stage's Ray actor pool, through the
        generation cache under the model's identity (base weights, adapter content, resolved quantization); a
        KubeRay RayJob per model and answer length with :class:`KubeRayJob` (``remote_budget``: the stage's guard,
        checked while it runs)."""
        return lambda: self._ray_answers(ctx, spec, role, base, adapter, dtypes, remote_budget)

    def _ray_answers(
        self, ctx, spec: CampaignSpec, role: str, base, adapter: dict | None, dtypes: dict | None, remote_budget=None
    ):
        from campaign_orchestrator.generation.factories import LocalModelFactory
        from campaign_orchestrator.generation.scaleout.job import AnswerFactory
        from campaign_orchestrator.generation.scaleout.stage import answers_on_ray
        from evaluation.judging import tally
        from stages.answers import answer_identity, batch_size

        s, q = spec.student, spec.student.quantization
        adapter_dir = adapter["adapter_path"] if adapter else None
        identity, _precision = answer_identity(spec, base, adapter)
        recipe = AnswerFactory(
            LocalModelFactory(
                str(base),
                str(adapter_dir) if adapter_dir else None,
                q.load_in_4bit,
                q.compute_dtype,
                batch_size=batch_size(spec),
            ),
            identity,
            model=f"{s.base_model} ({role})",
        )

        def generate(prompts, max_new_tokens):
            ex = self.at(f"{role}@{max_new_tokens}")
            forwarded = ex.forwarded_budget(None, remote_budget)
            outs, run, st = answers_on_ray(
                spec.execution,
                prompts,
                recipe,
                identity,
                max_new_tokens,
                lambda sampling: cache_config(ctx.store, identity, sampling),
                log=ctx.log.info,
                label=f"{role} answers",
                run=ex.runner("answers"),
                **({"budget": forwarded} if forwarded is not None else {}),
            )
            if dtypes is not None and st.compute_dtype:
                dtypes[role] = st.compute_dtype
            if dtypes is not None:  # answers generated/cached; shards done/total per model (the manifest's ray_shards)
                tally(dtypes.setdefault("_answers", {}), role, st)
                dtypes.setdefault("_ray", {})[f"{role}@{max_new_tokens}"] = f"{run.done}/{len(run.shards)}"
            return outs

        return generate


class KubeRayJob(RayPool):
    """A KubeRay RayJob per generation (``execution.kuberay``), launched with ``launch`` (the context's ``kuberay``
    launcher: ``launch(spec, stage, job, workdir, budget=, on_shard=)``), labelled with ``stage``, its job files in
    ``workdir`` (on the artifact root)."""

    def __init__(self, spec: CampaignSpec, launch, stage: str, workdir: Path):
        super().__init__(spec.execution)
        self.spec, self.launch, self.stage, self.workdir = spec, launch, stage, Path(workdir)

    def at(self, sub: str) -> KubeRayJob:
        """The same launch with its job files in ``workdir/sub`` (one directory per model and answer length)."""
        return KubeRayJob(self.spec, self.launch, self.stage, self.workdir / sub)

    def session(self, log):
        return nullcontext()  # each RayJob brings its own cluster

    def forwarded_budget(self, budget, remote_budget):
        return budget if budget is not None else remote_budget

    def runner(self, kind: str) -> Callable:
        """A runner with :func:`run_on_ray`'s signature that launches a RayJob of ``kind`` (``teacher_generations``,
        ``teacher_scoring``, ``answers``)."""
        if self.launch is None:
            from campaign_orchestrator.generation.scaleout.stage import KubeRayNotLaunched

            raise KubeRayNotLaunched(
                f"campaign {self.spec.name}: execution.kuberay is set but this stage was given no "
                f"KubeRay launcher (the `kuberay` resource) to launch its RayJob with"
            )

        def run(execution, prompts, recipe, identity, sampling, cache_config, *, log, label="generations", **kwargs):
            return run_on_kuberay(
                self.spec,
                self,
                kind,
                prompts,
                recipe,
                identity,
                sampling,
                cache_config,
                log=log,
                label=label,
                **kwargs,
            )

        return run


def _job_files(workdir: Path, prompts: Sequence[dict]) -> tuple[Path, Path]:
    """The job's prompt table written under ``workdir`` and its (cleared) output path: ``(prompts, output)``."""
    from campaign_orchestrator.dataset.prompts import write_prompts

    workdir.mkdir(parents=True, exist_ok=True)
    prompts_file, output = workdir / "prompts.parquet", workdir / "generations.parquet"
    output.unlink(missing_ok=True)  # an earlier attempt's rows are never read as this job's
    write_prompts(
        [{"id": str(p["id"]), "prompt": p["prompt"], "category": p.get("category")} for p in prompts], prompts_file
    )
    return prompts_file, output


def _run_line(run, stats, price) -> str:
    """What a finished RayJob did: shards, rows, lost workers, and what its shards cost when priced."""
    paid = [r.usd for r in run.shards if r.attempts]
    usd = "" if price is None else "; $ unknown (unpriced)" if any(u is None for u in paid) else f"; ${sum(paid):.6f}"
    return (
        f"{run.done}/{len(run.shards)} shards, {stats.generated} generated, {stats.cache_hits} cache hits, "
        f"{stats.failed} failed, {len(run.lost_workers)} lost worker(s){usd}"
    )


def run_on_kuberay(
    spec,
    launch: KubeRayJob,
    kind: str,
    prompts: Sequence[dict],
    recipe,
    identity: str,
    sampling,
    cache_config,
    *,
    log: Callable[[str], None],
    label: str,
    chat: bool = False,
    context: Sequence[dict] = (),
    context_categories: Sequence[str] | None = None,
    budget=None,
    price: Callable[[dict], list | None] | None = None,
    progress: Callable[[int], None] | None = None,
    on_shard=None,
    rate_limits=None,
    pool=None,
):
    """One stage's shards as a KubeRay RayJob: ``(GenerationResult, RayRun)`` as :func:`run_on_ray` returns them.
    (``rate_limits``: the driver takes them from the recipe's teacher section; ``pool``, ``on_shard``: local only.)"""
    from campaign_orchestrator.generation.rows import read_generations
    from campaign_orchestrator.generation.runner import GenerationError, GenerationResult
    from campaign_orchestrator.generation.scaleout.job import Job
    from campaign_orchestrator.generation.scaleout.stage import RayRun, price_shard, stats_from_dict

    if not prompts:
        raise GenerationError("no prompts to generate for: the prompt table is empty")
    workdir = Path(launch.workdir)
    prompts_file, output = _job_files(workdir, prompts)
    job = Job(
        kind,
        recipe,
        identity,
        str(prompts_file),
        str(output),
        asdict(cache_config),
        sampling.as_dict(),
        spec.execution.model_dump(mode="json"),
        chat=chat,
        context=[dict(m) for m in context],
        context_categories=list(context_categories) if context_categories is not None else None,
    )
    sent = 0

    def shard_progress(msg: dict) -> None:
        nonlocal sent
        n = int(msg.get("generated", 0)) + int(msg.get("failed", 0))
        sent += n
        if progress is not None and n:
            progress(n)

    t0 = time.perf_counter()
    out = launch.launch(spec, launch.stage, json.loads(job.to_json()), workdir, budget=budget, on_shard=shard_progress)
    summary = out["summary"]
    rows = read_generations(output)
    stats = stats_from_dict(summary["stats"])
    run = RayRun.from_dict(summary["ray"])
    for rep in run.shards:  # priced here, as the local pool's driver prices them: the stage's price callback
        if rep.attempts:
            price_shard(rep, price)
    if progress is not None and len(rows) > sent:  # cache hits, and rows of samples beyond the first
        progress(len(rows) - sent)
    wall = time.perf_counter() - t0
    log(f"{label}: RayJob {out['ray_job']} finished in {wall:.0f} s: {_run_line(run, stats, price)}")
    for f in (prompts_file, output):  # the rows are the stage's output now; the job file, summary and log stay
        f.unlink(missing_ok=True)
    return GenerationResult(rows, stats), run
