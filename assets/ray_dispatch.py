"""Where a generation stage's Ray shards run: the one place the teacher and evaluation assets choose it.

``execution.engine: ray`` runs a stage's prompts as shards on a Ray actor pool. Where that pool is:

- ``execution.kuberay`` unset: here, through :func:`campaign_orchestrator.generation.scaleout.stage.run_on_ray` (a local
  cluster the stage starts and stops, or the cluster at ``execution.ray_address``);
- ``execution.kuberay`` set: in a KubeRay ``RayJob`` the stage launches (``KubeRayJobLauncher``, the ``kuberay``
  resource). The stage writes the prompts (Parquet) and ``ray_job.json`` (a
  :class:`campaign_orchestrator.generation.scaleout.job.Job`) under its work directory on the artifact root, which the
  Ray
  pods mount at the same path; the job's driver runs ``python -m campaign_orchestrator.generation.scaleout`` inside the
  cluster, whose finished shards are charged to the stage's budget guard as they arrive (``ray_shard`` Pipes
  messages); the rows come back from the job's output Parquet, the statistics and shard reports from its
  summary, and each shard is priced here with the stage's ``price`` callback, as on a local cluster. The stage's
  cost lines (one set per shard, tagged with its id), manifest and metadata have the same shape either way.

:func:`ray_runner` returns the callable: both are called as ``run_on_ray`` is.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class KubeRayLaunch:
    """What a launch needs from the asset: its context, the ``kuberay`` resource, the stage the RayJob is labelled
    with, and the directory (on the artifact root) its job files go to."""

    context: Any
    launcher: Any  # resources.k8s.kuberay_launcher.KubeRayJobLauncher
    stage: str
    workdir: Path

    def at(self, sub: str) -> KubeRayLaunch:
        """The same launch with its job files in ``workdir/sub`` (one directory per model and answer length)."""
        return replace(self, workdir=Path(self.workdir) / sub)


def ray_runner(spec, launch: KubeRayLaunch | None, kind: str) -> Callable:
    """``run_on_ray`` for a campaign without ``execution.kuberay``; else a runner with its signature that launches
    a RayJob of ``kind`` (``teacher_generations``, ``teacher_scoring``, ``answers``) through ``launch``."""
    from campaign_orchestrator.generation.scaleout.stage import run_on_ray

    if spec.execution.kuberay is None:
        return run_on_ray
    if launch is None:
        from campaign_orchestrator.generation.scaleout.stage import KubeRayNotLaunched

        raise KubeRayNotLaunched(
            f"campaign {spec.name}: execution.kuberay is set but this stage was given no "
            f"KubeRay launcher (the `kuberay` resource) to launch its RayJob with"
        )

    def run(
        execution,
        prompts: Sequence[dict],
        recipe,
        identity: str,
        sampling,
        cache_config,
        *,
        log: Callable[[str], None],
        label: str = "generations",
        **kwargs,
    ):
        return run_on_kuberay(
            spec, launch, kind, prompts, recipe, identity, sampling, cache_config, log=log, label=label, **kwargs
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
    launch: KubeRayLaunch,
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
    out = launch.launcher.launch(
        launch.context, spec, launch.stage, json.loads(job.to_json()), workdir, budget=budget, on_shard=shard_progress
    )
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
