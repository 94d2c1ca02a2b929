"""Sweeps end to end on the demo (shrunk: a 90-step top rung, rungs at 30 and 90): bad learning rates are
pruned at the first rung, the best configuration beats the campaign's default and becomes the candidate the
gate judges; every trial is a Dagster partition, an MLflow run and ledger lines; a sweep SIGKILLed mid-rung
and rerun trains no finished rung again; the dollar cap stops it cleanly and holds (spend <= cap)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import yaml
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

from assets.location import build_definitions, campaign_job_name
from campaign_orchestrator.costs.ledger import Ledger
from campaign_orchestrator.costs.report import dollars
from campaign_orchestrator.demo import cipher
from tests.support import REPO_ROOT as REPO
from tests.support.sweep_run import run_sweep

pytestmark = pytest.mark.slow

LR_HIGH, LR_LOW = 1.0, 1e-4  # the shipped start points: 100x above and below the campaign's 1e-2
LR_DEFAULT = 5e-3  # the first test's trial 0


@pytest.fixture(scope="module")
def root(tmp_path_factory, demo_models_root) -> Path:
    """One artifact root for the module: the second test's teacher answers come from the first's cache."""
    from campaign_orchestrator.demo.recipe import model_dirs

    r = tmp_path_factory.mktemp("sweep") / "artifacts"
    (r / "models").mkdir(parents=True)
    for src in model_dirs(demo_models_root):
        if (src / "_SUCCESS").exists():
            (r / "models" / src.name).symlink_to(src, target_is_directory=True)
    return r


def _campaign(
    root: Path, name: str, *, sweep: dict | None = None, learning_rate: float | None = None, **sections
) -> Path:
    spec = yaml.safe_load((REPO / "campaigns" / "demo_sweep.yaml").read_text())
    if learning_rate is not None:
        spec["training"]["learning_rate"] = learning_rate
    data = root.parent / "data" / "prompts.jsonl"
    if not data.exists():
        cipher.write_jsonl(cipher.items(600, seed=99), data)
    spec["name"] = name
    spec["data"]["source"] = str(data)
    spec["data"]["heldout"] = {"fraction": 0.12, "seed": 0}
    spec["training"]["max_steps"] = 90
    spec["evaluation"]["gate"] |= {"min_items": 40, "min_category_items": 20}
    spec["evaluation"]["statistics"]["resamples"] = 2000
    spec["sweep"] |= {"heartbeat_s": 1, "grace_s": 3, **(sweep or {})}
    spec |= sections
    path = root.parent / "campaigns" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _metadata(result, key: AssetKey) -> dict:
    mats = list(result.asset_materializations_for_node(key.to_python_identifier()))
    assert mats, f"no materialization of {key.to_user_string()}"
    return {k: v.value for k, v in mats[-1].metadata.items()}


def _sweep_rows(root: Path, name: str) -> list[dict]:
    return Ledger(root / "cost_ledger.duckdb").query(
        "SELECT production_id, run_id, usd FROM cost_lines WHERE campaign = ? AND asset = 'hparam_sweep' "
        "ORDER BY recorded_at",
        [name],
    )


def test_sweep_prunes_bad_rates_early_and_its_best_trial_reaches_the_gate(root):
    name = "sweepy"
    # The campaign's own rate is a poor first guess here (half the rate that learns the task in 90 steps), and the
    # shipped start points
    # get a third, the demo's 1e-2: then a better configuration than trial 0 is always in reach. (With the
    # shipped 1e-2 as trial 0, whether one of the two sampled trials beats it depends on the host's float
    # rounding: on one CPU none did, and trial 0 was the only one left at the last rung.)
    path = _campaign(
        root,
        name,
        tracking={"mlflow": {}},
        learning_rate=LR_DEFAULT,
        sweep={
            "enqueue": [
                {"training.learning_rate": LR_HIGH},
                {"training.learning_rate": LR_LOW},
                {"training.learning_rate": 1e-2},
            ]
        },
    )
    defs = build_definitions([str(path)], artifact_root=str(root))
    instance = DagsterInstance.ephemeral()
    t0 = time.monotonic()
    result = defs.resolve_job_def(campaign_job_name(name)).execute_in_process(instance=instance, raise_on_error=False)
    wall = time.monotonic() - t0
    assert result.success
    m = json.loads((root / name / "hparam_sweep" / "LATEST.json").read_text())
    trials = m["trials"]
    assert m["rungs"] == [30, 90] and m["trials_run"] >= 6 and len(trials) == m["trials_run"]

    # the bad learning rates are pruned at the first rung; at least half of all trials are pruned there
    bad = [t for t in trials if t["params"]["training.learning_rate"] in (LR_HIGH, LR_LOW)]
    assert len(bad) == 2 and all(t["state"] == "PRUNED" and t["last_step"] == 30 for t in bad), bad
    assert m["pruned_at_first_rung"] >= m["trials_run"] / 2
    # the chosen configuration beats the campaign's own (trial 0) on the sweep metric
    assert trials[0]["params"] == m["default_params"] == {"training.learning_rate": LR_DEFAULT, "student.lora.r": 4}
    assert m["best_complete"] and m["best_value"] < m["default_value"], (m["best_value"], m["default_value"])
    assert m["best_params"] != m["default_params"]

    # the sweep metric's items (the tokenized validation split) are disjoint from the gate's held-out items
    prompts = json.loads((root / name / "prompts" / "LATEST.json").read_text())
    heldout = set(pq.read_table(prompts["heldout_path"], columns=["id"]).column("id").to_pylist())
    ds = json.loads((root / name / "tokenized_dataset" / "LATEST.json").read_text())
    val = {
        i
        for row in pq.read_table(ds["validation_path"], columns=["example_ids"]).column("example_ids").to_pylist()
        for i in row
    }
    assert len(val) >= 20 and len(heldout) >= 40 and not (val & heldout)

    # the chosen parameters reach student_adapter (the best trial's full-length adapter), and the gate judges it
    ad = _metadata(result, AssetKey([name, "student_adapter"]))
    assert ad["from_sweep_trial"] == m["best_trial"] and ad["cost"] == "$0"
    adapter = json.loads((root / name / "student_adapter" / "LATEST.json").read_text())
    cfg = json.loads((Path(adapter["adapter_path"]) / "adapter_config.json").read_text())
    assert cfg["r"] == m["best_params"]["student.lora.r"] and adapter["summary"]["steps"] == 90
    ev = _metadata(result, AssetKey([name, "evaluation"]))
    assert ev["verdict"] == "GO" and ev["cipher_candidate_score"] >= 0.8

    # every trial in Dagster: one partition each, materialized after every rung with its state and cost
    trial_key = AssetKey([name, "sweep_trial"])
    parts = instance.get_dynamic_partitions(f"{name}_sweep_trials")
    assert sorted(parts) == sorted(f"trial-{t['root']:03d}" for t in trials)
    for t in trials:
        recs = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=trial_key, asset_partitions=[f"trial-{t['root']:03d}"]), limit=10
        )
        mats = [r.asset_materialization for r in recs.records]
        assert len(mats) == len(t["rungs"])  # one per rung, latest first
        latest = {k: v.value for k, v in mats[0].metadata.items()}
        assert latest["state"] == t["state"] and latest["steps"] == t["last_step"]
        assert latest["cost"] == dollars(t["usd"]) and latest["params"] == t["params"]

    # money: one ledger production per trial and rung, summing to what the sweep reports
    rows = _sweep_rows(root, name)
    launches = sum(len(t["rungs"]) for t in trials)
    assert len(rows) == launches == len({r["production_id"] for r in rows})
    assert sum(r["usd"] for r in rows) == pytest.approx(m["spent_usd"]) and m["spent_usd"] <= m["cap_usd"]
    # the result's cost includes the sweep that chose it (the adopted adapter itself cost nothing more)
    cost = json.loads((root / name / "campaign_cost" / "LATEST.json").read_text())
    assert cost["stage_keys"]["hparam_sweep"] == m["key"]
    assert cost["training_usd"] == pytest.approx(m["spent_usd"])
    # the dashboard's sweep panel: every trial, its cost from the ledger
    html = (root / name / "campaign_cost" / "dashboard.html").read_text()
    assert 'id="sweep"' in html and all(f"<td>#{t['trial']}" in html for t in trials)

    # MLflow: one run per trial, one for the training, with parameters, per-step losses, cost and verdict
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    trial_runs = {int(r.data.tags["trial"]): r for r in runs if r.data.tags["kind"] == "sweep_trial"}
    assert sorted(trial_runs) == [t["trial"] for t in trials]
    for t in trials:
        r = trial_runs[t["trial"]]
        assert r.data.tags["verdict"] == t["state"] and r.data.metrics["cost_usd"] == pytest.approx(t["usd"])
        assert float(r.data.params["training.learning_rate"]) == pytest.approx(t["params"]["training.learning_rate"])
        assert [x.step for x in client.get_metric_history(r.info.run_id, "eval_loss")] == [int(s) for s in t["rungs"]]
        assert len(client.get_metric_history(r.info.run_id, "train_loss")) == t["last_step"]  # one per step
    (train,) = [r for r in runs if r.data.tags["kind"] == "training"]
    assert train.data.tags["verdict"] == "GO" and train.data.tags["from_sweep_trial"] == str(m["best_trial"])

    print(
        f"\nmeasured: {m['trials_run']} trials, {m['trials_pruned']} pruned ({m['pruned_at_first_rung']} at the first "
        f"rung), spent ${m['spent_usd']:.6f} of a ${m['cap_usd']:g} cap; trials took {m['trial_seconds']:.0f} s "
        f"against {m['every_trial_to_the_end_seconds']:.0f} s had every trial run to the end (saved "
        f"{m['time_saved_seconds']:.0f} s); best {m['best_params']} eval loss {m['best_value']:.4f} vs default "
        f"{m['default_value']:.4f}; whole campaign {wall:.0f} s"
    )


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and everything it started (the sweep and its trainer: a machine lost mid-rung)."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def test_sigkill_mid_rung_then_rerun_trains_no_finished_rung_again_and_the_cap_stops_it(root, tmp_path):
    from optuna.trial import TrialState

    from campaign_orchestrator.sweep import make_storage, make_study, storage_url
    from campaigns.loader import load_campaigns

    name = "sweep_kill"
    # no start points: the retry of the killed trial is then the only queued trial, and runs first
    path = _campaign(root, name, sweep={"budget_usd": 0.02, "enqueue": []})
    log = tmp_path / "first.log"
    first = subprocess.Popen(
        [sys.executable, "-m", "tests.support.sweep_run", str(path), str(root)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    sweep_dir = root / name / "hparam_sweep"
    deadline = time.monotonic() + 400
    node_log = None
    while True:  # trial 0 finished its first rung and is training its second
        assert time.monotonic() < deadline and first.poll() is None, log.read_text()[-3000:]
        logs = list(sweep_dir.glob("*/trial-000/node-0.log"))
        if logs and list(sweep_dir.glob("*/trial-000/rung-30.json")) and "steps 30→90" in logs[0].read_text():
            node_log = logs[0]
            break
        time.sleep(0.1)
    _kill_tree(first.pid)
    killed_rows = _sweep_rows(root, name)
    assert [r["production_id"].split(":", 2)[2] for r in killed_rows] == ["trial-000:rung-30"]
    spec = load_campaigns([str(path)]).campaigns[name]
    study_dir = node_log.parent.parent  # <root>/<campaign>/hparam_sweep/<sweep key>
    study = make_study(spec, make_storage(storage_url(spec, root), spec.sweep), f"{name}-{study_dir.name}")
    assert [t.number for t in study.get_trials(states=(TrialState.RUNNING,))] == [0]  # left RUNNING by the kill

    # the rerun's cap: about four more rungs at what this machine's first rung cost (the cap is not part of the
    # sweep's key: the same study goes on under it), so it stops before the six trials are done
    cap = round(killed_rows[0]["usd"] * 4.5, 6)
    data = yaml.safe_load(path.read_text())
    data["sweep"]["budget_usd"] = cap
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = run_sweep(str(path), str(root))
    assert result.success
    m = json.loads((sweep_dir / "LATEST.json").read_text())
    trials = study.get_trials()
    # nothing left RUNNING; the killed trial failed and its retry went on from its own checkpoint
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert trials[0].state == TrialState.FAIL
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == 0]
    assert retry.number == 1 and retry.params == trials[0].params and retry.state == TrialState.COMPLETE
    text = node_log.read_text()
    assert text.count("rung done at step 30/90") == 1  # the finished rung was never trained again
    resumes = [x for x in text.splitlines() if x.startswith("resumed from checkpoint ")]
    assert len(resumes) == 2 and all(x.endswith("(step 30 of 90)") for x in resumes)  # the killed launch, the retry
    rung90 = json.loads((study_dir / "trial-000" / "rung-90.json").read_text())
    assert rung90["resumed_from"] == 30 and rung90["trained_steps"] == 60
    rows = _sweep_rows(root, name)
    done = [r for r in rows if r["production_id"]]  # finished rungs; a rung the cap stopped inside: interrupted
    stopped_inside = [r for r in rows if not r["production_id"]]
    ids = [r["production_id"] for r in done]
    assert len(ids) == len(set(ids)) and len(stopped_inside) <= 1  # each rung of each trial billed once
    assert rows[0]["run_id"] == killed_rows[0]["run_id"] and all(r["run_id"] != rows[0]["run_id"] for r in rows[1:])

    # the cap is hard: the sweep stopped (before launching a rung, or inside one: every launch carries a budget
    # guard sized to what is left of the cap) before its trials were done, having spent at most the cap
    assert m["stopped_by_cap"] and m["trials_stopped_by_cap"] == 1 and m["trials_run"] < spec.sweep.trials
    assert m["spent_usd"] == pytest.approx(sum(r["usd"] for r in rows)) and m["spent_usd"] <= cap
    by_root: dict[int, set] = {}
    for t in m["trials"]:  # a trial and its retries share the original's directory
        by_root.setdefault(t["root"], set()).update(int(s) for s in t["rungs"])
    for r, rungs in by_root.items():  # no rung ran that is not in the summary
        files = {int(f.stem.split("-")[1]) for f in (study_dir / f"trial-{r:03d}").glob("rung-*.json")}
        assert files == rungs, (r, files, rungs)
    assert len(done) == sum(len(x) for x in by_root.values())  # ... and each is in the ledger once
    print(
        f"\nmeasured: killed mid-rung (trial 0, steps 30→90); rerun replayed rung 30 and resumed from its checkpoint; "
        f"cap ${cap}: spent ${m['spent_usd']:.6f} over {len(rows)} rung(s), {m['trials_run']} trial(s) run, "
        f"stopped: {m['stopped_by_cap']}"
    )
