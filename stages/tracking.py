"""Experiment tracking in MLflow (campaign ``tracking.mlflow``; off by default).

Every training run (``student_adapter``) and every sweep trial becomes an MLflow run in the campaign's
experiment: its parameters, its per-step training loss (and a trial's eval loss at each rung), its cost
and its verdict (a trial: PRUNED / COMPLETE / STOPPED; a training run: the gate's GO / NO-GO, set by the
evaluation stage on the run tagged with the adapter's content key). The client is ``mlflow-skinny``;
the default store is SQLite under the artifact root, a server URI works the same.
"""

from __future__ import annotations

import time
from pathlib import Path

from campaigns.spec import CampaignSpec


def tracking_uri(spec: CampaignSpec, artifact_root: Path) -> str:
    m = spec.tracking.mlflow
    if m.tracking_uri:
        return m.tracking_uri
    d = Path(artifact_root) / "mlflow"
    d.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{d / 'mlflow.db'}"


def _client(spec: CampaignSpec, artifact_root: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri(spec, artifact_root))
    name = spec.tracking.mlflow.experiment or spec.name
    exp = client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
    return client, exp_id


def _flat(params: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = str(v)[:500]
    return out


def _log(
    client, run_id: str, params: dict[str, str], metrics: list[tuple[str, float, int]], tags: dict[str, str]
) -> None:
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    ps = [Param(k, v) for k, v in params.items()]
    ms = [
        Metric(k, float(v), now, int(s)) for k, v, s in metrics if v is not None and v == v and abs(v) != float("inf")
    ]
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    for i in range(0, len(ps), 100):  # MLflow's batch limits: 100 params, 1000 metrics
        client.log_batch(run_id, params=ps[i : i + 100])
    for i in range(0, len(ms), 1000):
        client.log_batch(run_id, metrics=ms[i : i + 1000])


def _step_losses(path: Path) -> list[tuple[str, float, int]]:
    if not path.exists():
        return []
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["step", "loss"]).to_pydict()
    return [("train_loss", loss, step) for step, loss in zip(t["step"], t["loss"], strict=True)]


def log_trial(spec: CampaignSpec, artifact_root: Path, sweep_key: str, rec) -> str:
    """One MLflow run per trial (a retry of a killed trial is a run of its own, tagged with the original)."""
    client, exp = _client(spec, artifact_root)
    run = client.create_run(
        exp,
        run_name=f"{spec.name} sweep trial {rec.number}",
        tags={
            "campaign": spec.name,
            "kind": "sweep_trial",
            "sweep": sweep_key,
            "trial": str(rec.number),
            "trial_root": str(rec.root),
        },
    )
    metrics = [("eval_loss", r["value"], s) for s, r in sorted(rec.rungs.items())]
    metrics += _step_losses(
        Path(artifact_root) / spec.name / "hparam_sweep" / sweep_key / f"trial-{rec.root:03d}" / "metrics.parquet"
    )
    metrics.append(("cost_usd", rec.usd, max(rec.rungs) if rec.rungs else 0))
    _log(client, run.info.run_id, {k: str(v) for k, v in rec.params.items()}, metrics, {"verdict": rec.state})
    client.set_terminated(run.info.run_id, status="FINISHED" if rec.state in ("COMPLETE", "PRUNED") else "KILLED")
    return run.info.run_id


def log_training(spec: CampaignSpec, artifact_root: Path, manifest: dict, dagster_run_id: str) -> str:
    """The student_adapter run: every training and LoRA setting, per-step loss, eval loss, cost."""
    client, exp = _client(spec, artifact_root)
    run = client.create_run(
        exp,
        run_name=f"{spec.name} student_adapter {manifest['key'][:8]}",
        tags={
            "campaign": spec.name,
            "kind": "training",
            "adapter_key": manifest["key"],
            "dagster_run_id": dagster_run_id,
            **(
                {"from_sweep_trial": str(manifest["from_sweep_trial"])}
                if manifest.get("from_sweep_trial") is not None
                else {}
            ),
        },
    )
    params = _flat(
        {
            "training": spec.training.model_dump(
                include={
                    "learning_rate",
                    "warmup_steps",
                    "weight_decay",
                    "micro_batch_size",
                    "gradient_accumulation_steps",
                    "max_steps",
                    "max_seq_len",
                    "seed",
                }
            ),
            "lora": spec.student.lora.model_dump(include={"r", "alpha", "dropout"}),
            "distillation": spec.training.distillation.model_dump(include={"loss", "kl_weight"}),
        }
    )
    sm = manifest["summary"]
    usd = float(sum(x["usd"] for x in manifest.get("cost_lines", [])))
    metrics = _step_losses(Path(manifest["metrics_path"]))
    metrics += [
        ("eval_loss", sm.get("eval_loss"), sm["steps"]),
        ("eval_loss_before", sm.get("eval_loss_before"), 0),
        ("cost_usd", usd, sm["steps"]),
    ]
    _log(client, run.info.run_id, params, metrics, {"verdict": "pending gate"})
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def set_verdict(spec: CampaignSpec, artifact_root: Path, adapter_key: str, verdict: str) -> int:
    """Tag the training runs of ``adapter_key`` with the gate's verdict; how many were tagged."""
    client, exp = _client(spec, artifact_root)
    runs = client.search_runs([exp], filter_string=f"tags.adapter_key = '{adapter_key}'")
    for r in runs:
        client.set_tag(r.info.run_id, "verdict", verdict)
    return len(runs)
