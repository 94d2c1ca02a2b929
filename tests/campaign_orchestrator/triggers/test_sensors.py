"""The campaign's sensors and schedules, evaluated with Dagster's test contexts.

New data (local folder and S3 prefix): nothing without new files, a request after a new file,
nothing after a duplicate or touched file, thresholds, and a cursor that carries all the
sensor's memory (a restarted sensor with the stored cursor behaves the same). Model changes:
a new teacher re-materializes generations and everything downstream but not the prompts; a
new student base or training setting re-runs only its part. Schedules carry trigger tags.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import yaml
from dagster import (
    AssetKey,
    AssetMaterialization,
    DagsterInstance,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    SkipReason,
    build_schedule_context,
    build_sensor_context,
)

from assets.common import STAGES
from assets.location import build_definitions
from campaign_orchestrator.demo import cipher
from campaign_orchestrator.triggers.newdata import NewDataState, Threshold, observe
from campaign_orchestrator.triggers.sources import content_digest, list_source
from tests.support import REPO_ROOT as REPO


def write_campaign(tmp_path: Path, name: str = "watch", source: str | None = None, **automation) -> Path:
    spec = yaml.safe_load((REPO / "campaigns" / "demo.yaml").read_text())
    spec["name"] = name
    spec["data"]["source"] = source or str(tmp_path / "drops" / "*.jsonl")
    spec["automation"] = automation
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def drop(tmp_path: Path, name: str, n: int, seed: int) -> Path:
    return cipher.write_jsonl(cipher.items(n, seed=seed, id_prefix=f"{Path(name).stem}-"), tmp_path / "drops" / name)


class Sensor:
    """Evaluates a campaign's new-data sensor tick by tick, keeping only the stored cursor between
    ticks (each tick rebuilds the definitions: what a restarted daemon does)."""

    def __init__(self, campaign: Path, instance: DagsterInstance, name: str = "watch"):
        self.campaign, self.instance, self.name, self.cursor = campaign, instance, name, None

    def tick(self):
        defs = build_definitions([str(self.campaign)])
        ctx = build_sensor_context(instance=self.instance, cursor=self.cursor, definitions=defs)
        result = defs.resolve_sensor_def(f"{self.name}_new_data")(ctx)
        self.cursor = ctx.cursor
        return result


def test_content_digest_counts_rows_across_chunks():
    data = [b'{"a": 1}\n{"a"', b": 2}\n\n", b'{"a": 3}']
    sha, rows = content_digest(iter(data))
    import hashlib

    assert sha == hashlib.sha256(b"".join(data)).hexdigest() and rows == 3


def test_new_data_sensor_requests_once_per_new_content(tmp_path):
    drop(tmp_path, "prompts-0001.jsonl", 40, seed=1)
    sensor = Sensor(write_campaign(tmp_path, new_data={"enabled": True}), DagsterInstance.ephemeral())

    first = sensor.tick()
    assert isinstance(first, SkipReason) and "baseline" in first.skip_message
    assert "40 rows" in first.skip_message
    assert isinstance(sensor.tick(), SkipReason)  # nothing new

    drop(tmp_path, "prompts-0002.jsonl", 25, seed=2)
    req = sensor.tick()
    assert isinstance(req, RunRequest)
    assert req.tags["trigger"] == "sensor" and req.tags["campaign"] == "watch"
    assert "prompts-0002.jsonl" in req.tags["trigger_reason"] and "25 new rows" in req.tags["trigger_reason"]
    assert set(req.asset_selection) == {AssetKey(["watch", s]) for s in STAGES}
    assert req.run_key.startswith("new-data-")
    assert "no new data" in sensor.tick().skip_message  # consumed: never triggers again

    # A copy under another name, a touched file and a rewrite with identical bytes: not new data.
    shutil.copy(tmp_path / "drops" / "prompts-0002.jsonl", tmp_path / "drops" / "copy-of-0002.jsonl")
    os.utime(tmp_path / "drops" / "prompts-0001.jsonl", (time.time() + 5, time.time() + 5))
    p = tmp_path / "drops" / "prompts-0001.jsonl"
    p.write_bytes(p.read_bytes())
    assert "no new data" in sensor.tick().skip_message


def test_cursor_is_the_whole_memory_and_survives_a_restart(tmp_path):
    drop(tmp_path, "a.jsonl", 30, seed=1)
    campaign = write_campaign(tmp_path, new_data={"enabled": True})
    before = Sensor(campaign, DagsterInstance.ephemeral())
    before.tick()
    drop(tmp_path, "b.jsonl", 10, seed=2)
    assert isinstance(before.tick(), RunRequest)
    stored = before.cursor

    # "Restart": a new instance, freshly loaded definitions, only the stored cursor.
    after = Sensor(campaign, DagsterInstance.ephemeral())
    after.cursor = stored
    assert "no new data" in after.tick().skip_message
    state = NewDataState.from_cursor(after.cursor)
    assert {v["name"]: v["status"] for v in state.seen.values()} == {"a.jsonl": "baseline", "b.jsonl": "consumed"}
    drop(tmp_path, "c.jsonl", 5, seed=3)
    req = after.tick()
    assert isinstance(req, RunRequest) and "c.jsonl" in req.tags["trigger_reason"]
    assert "b.jsonl" not in req.tags["trigger_reason"]


def test_threshold_accumulates_pending_rows(tmp_path):
    drop(tmp_path, "base.jsonl", 100, seed=1)
    sensor = Sensor(
        write_campaign(tmp_path, new_data={"enabled": True, "min_new_rows": 20, "min_new_fraction": 0.3}),
        DagsterInstance.ephemeral(),
    )
    sensor.tick()
    drop(tmp_path, "d1.jsonl", 15, seed=2)
    below = sensor.tick()
    assert isinstance(below, SkipReason) and "below the threshold" in below.skip_message
    drop(tmp_path, "d2.jsonl", 10, seed=3)  # 25 rows: past 20 rows, but only +25% (< 30%)
    assert "below the threshold" in sensor.tick().skip_message
    drop(tmp_path, "d3.jsonl", 6, seed=4)  # 31 rows, +31%
    req = sensor.tick()
    assert isinstance(req, RunRequest)
    assert all(f in req.tags["trigger_reason"] for f in ("d1.jsonl", "d2.jsonl", "d3.jsonl"))
    assert req.tags["new_rows"] == "31"


def test_rewritten_file_counts_only_the_rows_it_gained(tmp_path):
    f = drop(tmp_path, "log.jsonl", 20, seed=1)
    state, th = NewDataState(), Threshold(min_new_rows=5)
    observe(state, list_source(str(tmp_path / "drops" / "*.jsonl"), tmp_path), th)
    rows = f.read_text().splitlines()
    more = cipher.items(23, seed=1, id_prefix="log-")[20:]
    f.write_text("\n".join(rows + [__import__("json").dumps(r) for r in more]) + "\n")
    d = observe(state, list_source(str(tmp_path / "drops" / "*.jsonl"), tmp_path), th)
    assert not d.request and d.new_rows == 3  # 3 rows gained: below 5
    # The unchanged file is not hashed again: its stat stamp is in the cursor.
    stamp = state.stat_cache[str(f)]
    assert stamp[1] == __import__("hashlib").sha256(f.read_bytes()).hexdigest()


def test_new_data_from_an_s3_prefix(tmp_path, monkeypatch):
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for k, v in {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(k, v)
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="drops")
        a = drop(tmp_path, "a.jsonl", 30, seed=1)
        s3.upload_file(str(a), "drops", "cipher/a.jsonl")
        s3.put_object(Bucket="drops", Key="cipher/notes.txt", Body=b"not a prompt file")
        sensor = Sensor(
            write_campaign(tmp_path, source="s3://drops/cipher/*.jsonl", new_data={"enabled": True}),
            DagsterInstance.ephemeral(),
        )
        assert "1 file(s), 30 rows" in sensor.tick().skip_message
        b = drop(tmp_path, "b.jsonl", 12, seed=2)
        s3.upload_file(str(b), "drops", "cipher/b.jsonl")
        req = sensor.tick()
        assert isinstance(req, RunRequest) and "b.jsonl" in req.tags["trigger_reason"]
        s3.upload_file(str(b), "drops", "cipher/b-again.jsonl")  # re-uploaded under another key
        assert "no new data" in sensor.tick().skip_message

        # The prompts stage reads the same prefix (downloaded by content), each content once.
        from campaign_orchestrator.triggers.sources import prompt_files

        files = prompt_files("s3://drops/cipher/*.jsonl", tmp_path, tmp_path / "cache")
        assert [f.name for f in files] == ["a.jsonl", "b-again.jsonl"]  # key order; b.jsonl is the same content
        assert (tmp_path / "cache" / "index.json").exists()
    finally:
        server.stop()


def record(instance: DagsterInstance, defs, only: set[str] | None = None) -> None:
    """Record materializations, in graph order, with the provenance tags a real run writes: the
    asset's current code version, a new data version, and the latest data version of each
    upstream asset."""
    graph = defs.resolve_asset_graph()
    keys = [
        k
        for k in graph.toposorted_asset_keys
        if k.path[0] in ("mc", "demo_models")
        and k.path[-1] != "drift_evaluation"
        and (only is None or k.to_user_string() in only)
    ]
    for k in keys:
        node = graph.get(k)
        tags = {
            "dagster/code_version": node.code_version or "none",
            "dagster/data_version": f"{k.to_user_string()}@{time.time_ns()}",
        }
        for parent in node.parent_keys:
            ev = instance.get_latest_materialization_event(parent)
            if ev is not None:
                tags[f"dagster/input_data_version/{parent.to_user_string()}"] = ev.asset_materialization.tags[
                    "dagster/data_version"
                ]
        instance.report_runless_asset_event(AssetMaterialization(k, tags=tags))


def test_model_changes_rematerialize_exactly_their_downstream(tmp_path, demo_models):
    teacher_dir = tmp_path / "models" / "teacher"
    shutil.copytree(demo_models["teacher"], teacher_dir)
    drop(tmp_path, "a.jsonl", 10, seed=1)
    spec = yaml.safe_load(write_campaign(tmp_path, "mc", model_change={"enabled": True}).read_text())
    spec["teacher"]["model"] = str(teacher_dir)  # a path model: its weights hash is part of the version
    campaign = tmp_path / "mc.yaml"
    instance = DagsterInstance.ephemeral()

    def tick(**changes):
        for section, values in changes.items():
            spec[section].update(values)
        campaign.write_text(yaml.safe_dump(spec))
        defs = build_definitions([str(campaign)])
        result = defs.resolve_sensor_def("mc_model_change")(build_sensor_context(instance=instance, definitions=defs))
        return result, defs

    never_run, defs = tick()
    assert "0/8 materialized" in never_run.skip_message  # a campaign never run is not re-run by itself
    record(instance, defs)
    assert "no stale stage" in tick()[0].skip_message

    after = {
        "teacher_generations": {f"mc/{s}" for s in STAGES[1:]},
        "tokenized_dataset": {f"mc/{s}" for s in STAGES[3:]},
        "student_adapter": {f"mc/{s}" for s in STAGES[4:]},
    }

    def requested(req):
        assert isinstance(req, RunRequest), getattr(req, "skip_message", req)
        assert req.tags["trigger"] == "model_change" and req.run_key.startswith("model-change-")
        return {k.to_user_string() for k in req.asset_selection}

    # A new teacher revision: generations and everything downstream, not the prompts.
    req, defs = tick(teacher={"revision": "v2"})
    assert requested(req) == after["teacher_generations"]
    assert (
        "mc/teacher_generations: code version" in req.tags["trigger_reason"]
        and "teacher:" in req.tags["trigger_reason"]
    )
    record(instance, defs, only=after["teacher_generations"])
    assert "no stale stage" in tick()[0].skip_message  # done: not requested again

    # Same path and revision, new weights on disk: seen at the next tick, without a reload.
    cfg = teacher_dir / "config.json"
    cfg.write_text(cfg.read_text() + "\n")
    req, defs = tick()
    assert requested(req) == after["teacher_generations"]
    record(instance, defs)

    # A new student base revision: tokenizing, training and after; not the teacher's work.
    req, defs = tick(student={"revision": "b2"})
    assert requested(req) == after["tokenized_dataset"]
    assert "mc/teacher_generations" not in req.tags["trigger_reason"]
    record(instance, defs)

    # A training setting: the adapter and after.
    req, defs = tick(training={"learning_rate": 1e-3})
    assert requested(req) == after["student_adapter"]
    record(instance, defs)

    # A rebuilt demo model (a new data version upstream) makes its consumers stale too.
    instance.report_runless_asset_event(
        AssetMaterialization(AssetKey(["demo_models", "student"]), tags={"dagster/data_version": "rebuilt"})
    )
    req, _ = tick()
    assert requested(req) == after["tokenized_dataset"]
    assert "upstream demo_models/student changed" in req.tags["trigger_reason"]

    # While a campaign run is in progress the sensor waits.
    from dagster._core.test_utils import create_run_for_test

    create_run_for_test(
        instance, job_name="mc_campaign", tags={"campaign": "mc"}, status=__import__("dagster").DagsterRunStatus.STARTED
    )
    assert "in progress" in tick()[0].skip_message


def test_sensor_and_schedule_defaults_follow_the_spec(tmp_path):
    drop(tmp_path, "a.jsonl", 5, seed=1)
    off = build_definitions([str(write_campaign(tmp_path, "quiet"))])
    for s in ("quiet_new_data", "quiet_model_change", "quiet_drift_retrain"):
        assert off.resolve_sensor_def(s).default_status == DefaultSensorStatus.STOPPED
    assert off.resolve_schedule_def("quiet_drift").default_status == DefaultScheduleStatus.STOPPED
    assert off.resolve_schedule_def("quiet_schedule").default_status == DefaultScheduleStatus.STOPPED

    spec = yaml.safe_load(
        write_campaign(
            tmp_path,
            "busy",
            new_data={"enabled": True, "interval_s": 15},
            model_change={"enabled": True},
            drift={"enabled": True, "cron": "30 5 * * 1", "timezone": "Europe/Paris"},
        ).read_text()
    )
    spec["schedule"] = {"cron": "0 2 * * *", "timezone": "UTC", "enabled": True}
    (tmp_path / "busy.yaml").write_text(yaml.safe_dump(spec))
    on = build_definitions([str(tmp_path / "busy.yaml")])
    for s in ("busy_new_data", "busy_model_change", "busy_drift_retrain"):
        assert on.resolve_sensor_def(s).default_status == DefaultSensorStatus.RUNNING
    assert on.resolve_sensor_def("busy_new_data").minimum_interval_seconds == 15
    drift = on.resolve_schedule_def("busy_drift")
    assert (drift.cron_schedule, drift.execution_timezone) == ("30 5 * * 1", "Europe/Paris")
    campaign = on.resolve_schedule_def("busy_schedule")
    assert campaign.default_status == DefaultScheduleStatus.RUNNING
    req = campaign.evaluate_tick(build_schedule_context(scheduled_execution_time=None)).run_requests[0]
    assert req.tags["trigger"] == "schedule" and "0 2 * * *" in req.tags["trigger_reason"]
    # A run launched from the job (UI launchpad, CLI) says it was manual; triggers override it.
    assert on.resolve_job_def("busy_campaign").tags["trigger"] == "manual"
    # The campaign job never includes the drift check; the drift job is only the drift check.
    keys = on.resolve_job_def("busy_campaign").asset_layer.selected_asset_keys
    assert AssetKey(["busy", "drift_evaluation"]) not in keys and AssetKey(["busy", "prompts"]) in keys


def test_shipped_instance_config_limits_the_pools(tmp_path):
    """Two campaigns' training (or teacher) steps never hold the same pool at once: with the
    shipped dagster.yaml, the second claim on a stage's pool is BLOCKED until the first is freed."""
    graph = build_definitions().resolve_asset_graph()
    pools = {stage: graph.get(AssetKey(["demo", stage])).pools for stage in ("teacher_generations", "student_adapter")}
    assert pools == {"teacher_generations": {"teacher"}, "student_adapter": {"gpu"}}
    shutil.copy(REPO / "campaign_app" / "dagster.yaml", tmp_path / "dagster.yaml")
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        config = instance.get_concurrency_config()
        assert config.pool_config.default_pool_limit == 1 and config.pool_config.pool_granularity.value == "op"
        assert config.run_queue_config.max_concurrent_runs == 4
        storage = instance.event_log_storage
        for (pool,) in pools.values():
            storage.initialize_concurrency_limit_to_default(pool)
            assert storage.get_concurrency_info(pool).slot_count == 1
            first = storage.claim_concurrency_slot(pool, "campaign-a-run", f"a__{pool}")
            second = storage.claim_concurrency_slot(pool, "campaign-b-run", f"b__{pool}")
            assert (first.slot_status.value, second.slot_status.value) == ("CLAIMED", "BLOCKED")
            storage.free_concurrency_slot_for_step("campaign-a-run", f"a__{pool}")
            assert storage.claim_concurrency_slot(pool, "campaign-b-run", f"b__{pool}").slot_status.value == "CLAIMED"


def test_definitions_read_campaign_files_and_artifacts_from_the_environment(tmp_path):
    import subprocess
    import sys

    drop(tmp_path, "a.jsonl", 5, seed=1)
    write_campaign(tmp_path, "elsewhere")
    code = (
        "import campaign_app.definitions as definitions; d = definitions.defs; "
        "print(sorted({k.path[0] for k in d.resolve_all_asset_keys()})); "
        "print(d.resources['storage'].root)"
    )
    env = {
        **os.environ,
        "CAMPAIGN_FILES": f"{tmp_path}/*.yaml{os.pathsep}{tmp_path}/none.yaml",
        "CAMPAIGN_ARTIFACTS": str(tmp_path / "art"),
    }
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    groups, root = out.stdout.strip().splitlines()[-2:]
    assert "elsewhere" in groups and "'demo'" not in groups and "invalid_campaigns" in groups  # none.yaml reported
    assert root == str(tmp_path / "art")
