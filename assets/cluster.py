"""The ``cluster`` asset group: the validation ladder (see ``training/cluster/ladder.py``), one asset per rung,
each with asset checks. Correctness checks block the rungs above them; checks against the
baseline fail (severity ERROR) naming what moved, and let the ladder continue so every number of
the run is still measured; a number that moved as far the *better* way fails with severity WARN
(rebaseline if intended). A rung that fails its correctness check is never recorded as a baseline.
Materialize with the ``cluster_validation`` job, or from the UI.

Files land in ``<artifact root>/cluster/<rung>/<run id>/``; baselines in
``<artifact root>/cluster/baselines/`` (or the resource's ``baseline_dir``).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetIn,
    AssetKey,
    AssetSelection,
    MetadataValue,
    Output,
    asset,
    define_asset_job,
)

from assets.common import demo_model_key, for_people
from assets.perf_metadata import profile_metadata
from campaigns import paths
from resources.cluster import ClusterValidation
from resources.local_launcher import LocalTorchrunLauncher
from resources.storage import ArtifactStore

GROUP = "cluster"
JOB = "cluster_validation"
STUDENT = "@demo/student"


def _key(rung: str) -> AssetKey:
    return AssetKey([GROUP, rung])


def _rung_dir(storage: ArtifactStore, rung: str, context: AssetExecutionContext) -> Path:
    d = storage.root_path() / GROUP / rung / context.run_id
    d.mkdir(parents=True, exist_ok=True)
    return d


def _store(storage: ArtifactStore, cluster: ClusterValidation):
    from training.cluster.baseline import BaselineStore

    return BaselineStore(cluster.baselines(storage.root_path()))


def _baseline_check(name: str, verdict, metrics: dict[str, float]) -> AssetCheckResult:
    """A regression fails (ERROR); only improvements beyond the thresholds fail as a warning (WARN)."""
    md = {
        "baseline_recorded": verdict.recorded,
        "changes": MetadataValue.md("\n".join(f"- {c.message()}" for c in verdict.changes) or "- none"),
        "current": MetadataValue.json(metrics),
    }
    if verdict.improvements:
        md["improvements"] = MetadataValue.md("\n".join(f"- {c.message()}" for c in verdict.improvements))
    if verdict.baseline:
        md["baseline"] = MetadataValue.json(verdict.baseline["metrics"])
        md["baseline_taken_at"] = verdict.baseline["taken_at"]
    if verdict.environment_changes:
        md["environment_changes"] = MetadataValue.md("\n".join(f"- {c}" for c in verdict.environment_changes))
    return AssetCheckResult(
        check_name=name,
        passed=verdict.passed and not verdict.warning,
        severity=AssetCheckSeverity.WARN if verdict.warning else AssetCheckSeverity.ERROR,
        description=verdict.summary(),
        metadata=md,
    )


# --------------------------------------------------------------------------- rung 1


def _environment_smoke(out: Path, timeout_s: float) -> dict:
    """Run ``training.cluster.smoke env`` in a fresh interpreter; returns the environment it wrote to ``out``."""
    done = subprocess.run(
        [sys.executable, "-m", "training.cluster.smoke", "env", "--out", str(out)],
        cwd=paths.project_dir(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(f"environment smoke failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _devices_visible(env: dict, need: int) -> tuple[bool, str]:
    """(ok, why): ``need`` GPUs per node and NCCL, or gloo when no GPU is visible."""
    if env["cuda_available"]:
        ok = env["device_count"] >= need and env["nccl_available"]
        why = (
            f"{env['device_count']} GPU(s) visible ({', '.join(env['devices'])}), {need} needed per node; NCCL "
            f"{env['nccl_version'] or 'missing'}"
        )
    else:
        ok = env["gloo_available"]
        why = (
            f"no GPU: {need} gloo process(es) per node on {env.get('usable_cpus', env['cpu_count'])} usable CPU core(s)"
        )
    return ok, why


def _environment_change_text(first: bool, rebaseline: bool, changes: list[str]) -> str:
    if first:
        return "baseline recorded"
    if rebaseline:
        return "rebaselined" + (f"; changes accepted: {'; '.join(changes)}" if changes else "")
    return ("changed since the baseline: " + "; ".join(changes)) if changes else "unchanged since the baseline"


@asset(
    key=_key("environment"),
    group_name=GROUP,
    kinds={"python"},
    description="Rung 1: the software stack loads and sees its devices (versions, CUDA, NCCL, driver).",
    check_specs=[
        AssetCheckSpec(
            "devices_visible",
            asset=_key("environment"),
            blocking=True,
            description="The devices the ladder needs are visible (or gloo on CPU).",
        ),
        AssetCheckSpec(
            "environment_vs_baseline",
            asset=_key("environment"),
            description="Versions and driver unchanged since the baseline (warning).",
        ),
    ],
)
def environment(context: AssetExecutionContext, storage: ArtifactStore, cluster: ClusterValidation):
    from training.cluster import ladder
    from training.cluster.baseline import environment_changes
    from training.cluster.smoke import fingerprint

    out = _rung_dir(storage, "environment", context) / "environment.json"
    env = _environment_smoke(out, cluster.timeout_s)
    shape = ladder.shape(env, cluster.nodes, cluster.processes_per_node)
    fp = fingerprint(env)
    store = _store(storage, cluster)
    base = store.load("environment", shape)
    changes = environment_changes(fp, base["environment"]) if base else []
    if base is None or cluster.rebaseline:
        store.save("environment", shape, {}, fp)
    ok, why = _devices_visible(env, cluster.processes_per_node)
    yield Output(
        {"environment": env, "shape": shape, "fingerprint": fp, "path": str(out)},
        metadata={
            "shape": shape,
            "backend": env["backend"],
            "device_count": env["device_count"],
            "devices": ", ".join(env["devices"]) or "cpu",
            "torch": env["versions"]["torch"] or "missing",
            "cuda": str(env["cuda_version"]),
            "nccl": str(env["nccl_version"]),
            "driver": str(env["driver_version"]),
            "versions": MetadataValue.json(env["versions"]),
            "report": MetadataValue.path(str(out)),
        },
    )
    yield AssetCheckResult(
        check_name="devices_visible",
        passed=bool(ok),
        description=why,
        metadata={"device_count": env["device_count"], "backend": env["backend"]},
    )
    yield AssetCheckResult(
        check_name="environment_vs_baseline",
        passed=not changes or cluster.rebaseline,
        severity=AssetCheckSeverity.WARN,
        description=_environment_change_text(base is None, cluster.rebaseline, changes),
        metadata={"changes": MetadataValue.md("\n".join(f"- {c}" for c in changes) or "- none")},
    )


# --------------------------------------------------------------------------- rung 2


@asset(
    key=_key("allreduce_smoke"),
    group_name=GROUP,
    kinds={"pytorch"},
    ins={"env": AssetIn(_key("environment"))},
    description="Rung 2: ranks reduce gradients correctly (SUM and AVG all-reduce vs a one-process reference).",
    check_specs=[
        AssetCheckSpec(
            "gradient_equality",
            asset=_key("allreduce_smoke"),
            blocking=True,
            description="All-reduced gradients equal the single-process gradient.",
        ),
        AssetCheckSpec(
            "allreduce_vs_baseline",
            asset=_key("allreduce_smoke"),
            description="The gradient differences (deterministic on one stack) unchanged since the baseline.",
        ),
    ],
)
def allreduce_smoke(context: AssetExecutionContext, env: dict, storage: ArtifactStore, cluster: ClusterValidation):
    from training.cluster import ladder
    from training.cluster.smoke import gradients_equal
    from training.cluster.torchrun import run_torchrun

    d = _rung_dir(storage, "allreduce_smoke", context)
    t0 = time.perf_counter()
    run_torchrun(
        ["-m", "training.cluster.smoke", "allreduce", "--out", str(d / "allreduce.json")],
        cluster.nodes,
        cluster.processes_per_node,
        d,
        cluster.env(),
        cluster.timeout_s,
    )
    wall = time.perf_counter() - t0
    result = json.loads((d / "allreduce.json").read_text())
    ok, why = gradients_equal(result)
    metrics = ladder.allreduce_metrics(result, wall)
    verdict = ladder.check_allreduce(
        _store(storage, cluster), env["shape"], result, env["fingerprint"], ok, cluster.rebaseline, wall
    )
    yield Output(
        result | {"path": str(d)},
        metadata=for_people(
            {
                "world_size": result["world_size"],
                "backend": result["backend"],
                "sum_max_abs_diff": result["sum_max_abs_diff"],
                "avg_max_abs_diff": result["avg_max_abs_diff"]
                if result["avg_max_abs_diff"] is not None
                else float("nan"),
                "ranks_agree": result["ranks_agree"],
                "wall_seconds": wall,
            }
        ),
    )
    yield AssetCheckResult(
        check_name="gradient_equality",
        passed=ok,
        description=why,
        metadata={"sum_max_abs_diff": result["sum_max_abs_diff"]},
    )
    yield _baseline_check("allreduce_vs_baseline", verdict, metrics)


# --------------------------------------------------------------------------- rung 3


def _sweep_args(cluster: ClusterValidation) -> list[str]:
    return ["--max-bytes", cluster.max_bytes, "--iters", str(cluster.iters), "--warmup", str(cluster.warmup)]


@asset(
    key=_key("collective_bandwidth"),
    group_name=GROUP,
    kinds={"pytorch"},
    ins={"env": AssetIn(_key("environment"))},
    deps=[_key("allreduce_smoke")],
    description="Rung 3: all_reduce / all_gather / reduce_scatter bandwidth from 8 B up (nccl-tests busbw).",
    check_specs=[
        AssetCheckSpec(
            "collectives_correct",
            asset=_key("collective_bandwidth"),
            blocking=True,
            description="Every message size returned the exact result.",
        ),
        AssetCheckSpec(
            "bandwidth_vs_baseline",
            asset=_key("collective_bandwidth"),
            description="Bus-bandwidth plateau and latency floor within thresholds of the baseline.",
        ),
    ],
)
def collective_bandwidth(context: AssetExecutionContext, env: dict, storage: ArtifactStore, cluster: ClusterValidation):
    from training.cluster import ladder
    from training.cluster.collectives import render
    from training.cluster.torchrun import run_torchrun

    d = _rung_dir(storage, "collective_bandwidth", context)
    run_torchrun(
        ["-m", "training.cluster.collectives", *_sweep_args(cluster), "--out", str(d / "sweep.json")],
        cluster.nodes,
        cluster.processes_per_node,
        d,
        cluster.env(),
        cluster.timeout_s,
    )
    sweep = json.loads((d / "sweep.json").read_text())
    context.log.info("\n" + render(sweep))
    metrics = ladder.bandwidth_metrics(sweep)
    wrong = ladder.sweep_wrong(sweep)
    verdict = ladder.check_bandwidth(
        _store(storage, cluster),
        env["shape"],
        sweep,
        env["fingerprint"],
        cluster.plateau_drop,
        cluster.latency_rise,
        cluster.rebaseline,
    )
    md = {
        "sweep": MetadataValue.md(ladder.bandwidth_markdown(sweep)),
        "result": MetadataValue.path(str(d / "sweep.json")),
        "world_size": sweep["world_size"],
        "backend": sweep["backend"],
        "max_bytes": sweep["max_bytes"],
    }
    md |= {k.replace(".", "_"): v for k, v in metrics.items()}
    yield Output({"path": str(d), "summary": sweep["summary"], "metrics": metrics}, metadata=md)
    yield AssetCheckResult(
        check_name="collectives_correct",
        passed=not any(wrong.values()),
        description="; ".join(f"{op}: {n} wrong size(s)" for op, n in wrong.items()),
        metadata={"wrong": MetadataValue.json(wrong)},
    )
    yield _baseline_check("bandwidth_vs_baseline", verdict, metrics)


# --------------------------------------------------------------------------- rung 4


def _tiny_train_job(cluster: ClusterValidation, student: Path, dataset: Path, out: Path):
    """The rung's :class:`training.config.TrainJob`: the real trainer, profiled, on the ladder's shape."""
    from campaigns.spec import DistributedEnvSpec, ProfilingSpec, StudentSpec, TrainingSpec
    from training.config import TrainJob

    training = TrainingSpec(
        max_steps=cluster.train_steps,
        learning_rate=cluster.learning_rate,
        warmup_steps=5,
        micro_batch_size=cluster.micro_batch_size,
        max_seq_len=64,
        nodes=cluster.nodes,
        processes_per_node=cluster.processes_per_node,
        sharding="hybrid" if cluster.nodes > 1 else "full",
        log_every=10,
        profiling=ProfilingSpec(enabled=True),
        distributed_env=DistributedEnvSpec(**cluster.distributed_env),
    )
    return TrainJob(
        campaign=GROUP,
        base_model_path=str(student),
        dataset_path=str(dataset),
        output_dir=str(out),
        student=StudentSpec(base_model=STUDENT),
        training=training,
    )


@asset(
    key=_key("tiny_training"),
    group_name=GROUP,
    kinds={"pytorch"},
    pool="gpu",
    ins={"env": AssetIn(_key("environment"))},
    deps=[_key("collective_bandwidth"), demo_model_key(STUDENT)],
    description="Rung 4: the real trainer (QLoRA, FSDP2, profiled) learns the cipher task on this cluster.",
    check_specs=[
        AssetCheckSpec(
            "loss_decreased",
            asset=_key("tiny_training"),
            blocking=True,
            description="The final loss is below half the first loss.",
        ),
        AssetCheckSpec(
            "throughput_vs_baseline",
            asset=_key("tiny_training"),
            description="Tokens per second within the threshold of the baseline.",
        ),
    ],
)
def tiny_training(
    context: AssetExecutionContext,
    env: dict,
    storage: ArtifactStore,
    cluster: ClusterValidation,
    launcher: LocalTorchrunLauncher,
):
    from training.cluster import ladder

    d = _rung_dir(storage, "tiny_training", context)
    student = storage.resolve_model(STUDENT)
    train, heldout = ladder.tiny_task(cluster.train_items, cluster.eval_items)
    dataset = ladder.tokenize_tiny(student, train, d / "dataset")
    (d / "heldout.json").write_text(json.dumps(heldout))
    out = d / "run"
    launcher.launch(context, _tiny_train_job(cluster, student, dataset, out), out)
    s = json.loads((out / "summary.json").read_text())
    metrics = {"tokens_per_s": float(s["tokens_per_s"])}
    ok = s["final_loss"] is not None and s["first_loss"] is not None and s["final_loss"] < 0.5 * s["first_loss"]
    verdict = _store(storage, cluster).check(
        "tiny_training",
        env["shape"],
        metrics,
        env["fingerprint"],
        ladder.training_rules(cluster.throughput_drop),
        cluster.rebaseline,
        record=bool(ok),
    )
    md = {
        "adapter": MetadataValue.path(s["adapter_dir"]),
        "steps": s["steps"],
        "first_loss": s["first_loss"],
        "final_loss": s["final_loss"],
        "tokens_per_s": s["tokens_per_s"],
        "train_seconds": s["train_seconds"],
        "world_size": s["world_size"],
    } | profile_metadata(out)
    yield Output(
        {
            "adapter_path": s["adapter_dir"],
            "base_model_path": str(student),
            "heldout_path": str(d / "heldout.json"),
            "summary": s,
            "path": str(d),
        },
        metadata=for_people(md),
    )
    yield AssetCheckResult(
        check_name="loss_decreased", passed=bool(ok), description=f"loss {s['first_loss']} → {s['final_loss']}"
    )
    yield _baseline_check("throughput_vs_baseline", verdict, metrics)


# --------------------------------------------------------------------------- rung 5


def _run_gate(trained: dict, d: Path, min_score: float, log) -> tuple[dict, str]:
    """The real evaluation gate on the rung-4 adapter against its base over the held-out cipher items; writes
    ``items.parquet`` and ``gate.json`` under ``d``. Returns (report, report markdown)."""
    from campaign_orchestrator.generation.local import LocalModel
    from evaluation.gate import GatePolicy, StatsPolicy, combine
    from evaluation.report import build_report
    from evaluation.runner import BASE, CANDIDATE, SuiteGate, SuiteRun, answer_suites, judge, scores
    from evaluation.scorers import build_scorer
    from evaluation.suite import read_item_results, write_item_rows

    items = json.loads(Path(trained["heldout_path"]).read_text())
    scorer = build_scorer("exact_match")
    suites = [SuiteRun("cipher", items, scorer, 16)]

    def local(adapter_dir=None):
        def factory():
            g = LocalModel.from_path(trained["base_model_path"], adapter_dir, True, "bfloat16", batch_size=64)
            return lambda prompts, n: g.generate(prompts, n)

        return factory

    rows = answer_suites(suites, {CANDIDATE: local(trained["adapter_path"]), BASE: local()}, log=log)
    res = read_item_results(write_item_rows(rows, d / "items.parquet"))
    policy = GatePolicy(min_score=min_score, min_items=min(20, len(items)))
    sp = StatsPolicy()
    reports = judge(res, [SuiteGate("cipher", policy, scorer.binary)], sp)
    doc = build_report(
        reports, {"cipher": (res[CANDIDATE]["cipher"], res[BASE]["cipher"])}, sp, trained.get("key", "ladder")
    )
    verdict_text = combine(reports)
    result_scores = scores(res)
    report = {
        "verdict": verdict_text,
        "scores": result_scores,
        "suites": [r.as_dict() for r in reports],
        "reasons": doc["reasons"],
    }
    (d / "gate.json").write_text(json.dumps(report, indent=2))
    return report, doc["markdown"]


@asset(
    key=_key("eval_gate"),
    group_name=GROUP,
    kinds={"pytorch"},
    ins={"env": AssetIn(_key("environment")), "trained": AssetIn(_key("tiny_training"))},
    description="Rung 5: the adapter trained on this cluster beats its base through the real evaluation gate.",
    check_specs=[
        AssetCheckSpec(
            "gate",
            asset=_key("eval_gate"),
            blocking=True,
            description="GO from the evaluation gate (floor, regression vs base, empties).",
        ),
        AssetCheckSpec(
            "score_vs_baseline",
            asset=_key("eval_gate"),
            description="Candidate score within the threshold of the baseline.",
        ),
    ],
)
def eval_gate(
    context: AssetExecutionContext, env: dict, trained: dict, storage: ArtifactStore, cluster: ClusterValidation
):
    from training.cluster import ladder

    d = _rung_dir(storage, "eval_gate", context)
    report, markdown = _run_gate(trained, d, cluster.gate_min_score, context.log.info)
    verdict_text, result_scores = report["verdict"], report["scores"]
    candidate = result_scores["candidate"]["cipher"] or 0.0
    metrics = {"candidate_score": float(candidate)}
    bverdict = _store(storage, cluster).check(
        "eval_gate",
        env["shape"],
        metrics,
        env["fingerprint"],
        ladder.gate_rules(cluster.score_drop),
        cluster.rebaseline,
        record=verdict_text == "GO",
    )
    yield Output(
        report | {"path": str(d)},
        metadata={
            "verdict": verdict_text,
            "candidate_score": float(candidate),
            "base_score": float(result_scores["base"]["cipher"] or 0.0),
            "report": MetadataValue.md(markdown),
        },
    )
    yield AssetCheckResult(
        check_name="gate",
        passed=verdict_text == "GO",
        severity=AssetCheckSeverity.ERROR,
        description=f"gate {verdict_text}" + (f": {'; '.join(report['reasons'])}" if report["reasons"] else ""),
    )
    yield _baseline_check("score_vs_baseline", bverdict, metrics)


ASSETS = [environment, allreduce_smoke, collective_bandwidth, tiny_training, eval_gate]


def job():
    """``cluster_validation``: the whole ladder (and the demo student it trains, if not built yet)."""
    return define_asset_job(
        JOB,
        selection=AssetSelection.groups(GROUP).upstream().required_multi_asset_neighbors(),
        description="Validate the cluster rung by rung: environment, all-reduce correctness, "
        "collective bandwidth, tiny training, eval gate; each against its baseline.",
        tags={"ladder": "cluster"},
    )
