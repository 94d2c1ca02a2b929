"""The KubeRay launcher's whole lifecycle against the emulated Kubernetes API (kmock over HTTP), as the training
launcher's: a Dagster asset launches a generation stage of ``campaigns/examples/cluster_ray.yaml`` as a RayJob, a
fake KubeRay operator (tests/support/kuberay_fake.py) creates the head, the worker pods and the submitter, the
driver talks back through real Dagster Pipes messages in the submitter's log, and the launcher streams them into
the asset, fails fast on a dead head or submitter, tolerates a dead worker, and deletes the RayJob it created."""

from __future__ import annotations

import _thread
import base64
import json
import threading
import time
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, DagsterInstance, Failure, MaterializeResult, asset, materialize

from assets.common import dagster_failures
from campaigns.loader import parse_campaign_text
from resources import run_owner
from resources.k8s.kuberay_launcher import KubeRayJobLauncher, job_paths
from tests.support import REPO_ROOT
from tests.support.k8s_fake_cluster import NS, EmulatedApiServer
from tests.support.kuberay_fake import GROUP, PLURAL, VERSION, FakeKubeRayOperator, driver_program

PLANTED = "hf_PLANTED_SECRET_value_3b9d1e"  # lives only in a Kubernetes Secret and the Dagster process env
# "Stops fast" tells a stopped job from one left to run: the driver would take FAR shards of 0.05 s (~200 s), ten
# times the bound, so a loaded host (which slows the Dagster run around the job, not the driver's sleeps) cannot
# bridge it.
FAR, FAST_S = 4000, 100

# The driver's stand-in for `python -m campaign_orchestrator.generation.scaleout --job JOB.json`: Pipes over stderr.
DRIVER = r"""
import json, os, sys, time
from pathlib import Path
from dagster_pipes import open_dagster_pipes
job = json.loads(Path(sys.argv[sys.argv.index("--job") + 1]).read_text())
assert os.environ.get("HF_TOKEN"), "secretKeyRef was not resolved"
shards = int(job["execution"]["fake_shards"])
# the real driver's budget messages (campaign_orchestrator/generation/scaleout)
usage = job["execution"].get("fake_usage")
with open_dagster_pipes() as pipes:
    print(f"driver: {job['kind']} on {job['execution']['replicas']} replicas", flush=True)
    if usage:
        pipes.report_custom_message({"kind": "ray_plan", "share": 1.0})
    for i in range(1, shards + 1):
        time.sleep(float(job["execution"]["fake_shard_s"]))
        pipes.log.info(f"shard {i}/{shards} done")
        if usage:
            pipes.report_custom_message({"kind": "ray_shard", "shard": f"s{i:04d}", "generated": 10, "failed": 0,
                                         "prompt_tokens": 100, "completion_tokens": 50, "seconds": 0.5,
                                         "shards_done": i, "shards_total": shards, "final": i == shards})
        else:
            pipes.report_custom_message({"kind": "ray_progress", "shards_done": i, "shards_total": shards})
    if job["execution"].get("fail"):
        print("Traceback (most recent call last):\nShardFailed: shard 3 failed on worker node 10.0.0.7", flush=True)
        sys.exit(1)
    import pyarrow.parquet as pq
    rows = pq.read_metadata(job["prompts"]).num_rows  # what the real driver answers: the job's prompts
    pipes.report_asset_materialization(metadata={"rows": rows, "shards_done": shards})
    summary = sys.argv[sys.argv.index("--summary") + 1]
    Path(summary).write_text(json.dumps({"rows": rows, "shards_done": shards, "shards_total": shards}))
print("driver: exiting", flush=True)
"""


@pytest.fixture
def api_server():
    with EmulatedApiServer() as server:
        yield server


@pytest.fixture
def spec(tmp_path):
    raw = yaml.safe_load((REPO_ROOT / "campaigns/examples/cluster_ray.yaml").read_text())
    raw["kubernetes"]["artifacts"]["mount_path"] = str(tmp_path / "artifacts")  # the shared volume
    raw["kubernetes"]["secret_env"] = [{"name": "HF_TOKEN", "secret": "huggingface", "key": "token"}]
    raw["execution"]["replicas"] = 3
    return parse_campaign_text(yaml.safe_dump(raw), "cluster_ray.yaml")


def _job(spec, tmp_path, shards=3, shard_s=0.05, prompts=5, **extra) -> dict:
    """A job file for the stand-in driver, its ``prompts`` rows written to the shared volume."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(spec.kubernetes.artifacts.mount_path)
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.table({"id": [f"p{i}" for i in range(prompts)], "prompt": ["q"] * prompts}), root / "prompts.parquet"
    )
    return {
        "kind": "teacher_generations",
        "prompts": str(root / "prompts.parquet"),
        "output": str(root / "out" / "rows.parquet"),
        "cache": {"store_url": str(root / "cache"), "spool_dir": str(root / "spool")},
        "execution": {"replicas": spec.execution.replicas, "fake_shards": shards, "fake_shard_s": shard_s, **extra},
    }


def _plant_secret(server):
    from kubernetes import client

    client.CoreV1Api(server.api()).create_namespaced_secret(
        NS,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "huggingface", "namespace": NS},
            "data": {"token": base64.b64encode(PLANTED.encode()).decode()},
        },
    )


def _run(spec, job, server, tmp_path, monkeypatch, budget=None, **launcher_kw):
    """Materialize a teacher_generations asset whose body is the launch (as the stage's Ray branch calls it)."""
    monkeypatch.setenv("HF_TOKEN", PLANTED)  # in the Dagster process too: it must not leak from there either
    launcher = KubeRayJobLauncher(
        kubeconfig_file=str(server.write_kubeconfig(tmp_path / "kubeconfig")),
        poll_interval_s=0.1,
        log_drain_timeout_s=10,
        **launcher_kw,
    )
    workdir = Path(spec.kubernetes.artifacts.mount_path) / spec.name / "teacher_generations" / "k1"

    @asset(key=AssetKey([spec.name, "teacher_generations"]))
    def teacher_generations(context, kuberay: KubeRayJobLauncher) -> MaterializeResult:
        with dagster_failures():  # a budget stop (a stage error) as the asset adapters report it
            out = kuberay.launch(context, spec, "teacher_generations", job, workdir, budget=budget)
        return MaterializeResult(
            metadata={**out["pipes_metadata"], "ray_job": out["ray_job"], "summary_rows": out["summary"]["rows"]}
        )

    instance = DagsterInstance.ephemeral()
    t0 = time.monotonic()
    result = materialize(
        [teacher_generations], instance=instance, raise_on_error=False, resources={"kuberay": launcher}
    )
    return result, instance, time.monotonic() - t0


def _failure(result):
    ev = next(e for e in result.all_events if e.is_step_failure)
    return ev.step_failure_data.user_failure_data


def _rayjobs(server) -> list[str]:
    from kubernetes import client

    items = client.CustomObjectsApi(server.api()).list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"]
    return [i["metadata"]["name"] for i in items]


def _pods(server) -> list[str]:
    from kubernetes import client

    return [p.metadata.name for p in client.CoreV1Api(server.api()).list_namespaced_pod(NS).items]


def test_success_streams_the_drivers_messages_deletes_the_rayjob_and_leaks_no_secret(
    api_server, spec, tmp_path, monkeypatch
):
    _plant_secret(api_server)
    # shards of 0.5 s: the job outlasts worker 1's crash (0.3 s after it starts) by several polls, so the launcher
    # sees the crashed pod before the job ends (with 0.05 s shards a fast driver could finish first)
    job = _job(spec, tmp_path, shard_s=0.5, prompts=23)
    with FakeKubeRayOperator(api_server, driver_program(DRIVER), crash_workers={1: "worker 1: OOM"}) as operator:
        result, instance, _ = _run(spec, job, api_server, tmp_path, monkeypatch)
        gone = operator.wait_all_deleted()
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    (rj,) = operator.created
    assert rj["kind"] == "RayJob" and rj["metadata"]["labels"]["dagster/run-id"] == result.run_id
    assert rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 3
    assert (
        json.loads(instance.get_run_by_id(result.run_id).tags[run_owner.OWNER_TAG])["k8s"]["namespace"] == NS
    )  # reaper's
    # the driver's Pipes messages: log lines at once, progress as observations, the result as the materialization
    logs = [r.user_message for r in instance.all_logs(result.run_id)]
    assert any("shard 3/3 done" in m for m in logs)
    # the crashed worker (exit 137) is named once, by its pod, and does not fail the stage: Ray owns its shards
    (crashed,) = [pod for pod, lines in api_server.logs.items() if any("worker 1: OOM" in x for x in lines)]
    assert [m for m in logs if crashed in m] == [m for m in logs if "OOMKilled" in m] and len(
        [m for m in logs if crashed in m and "exit code 137" in m]
    ) == 1
    obs = [
        e.asset_observation_data.asset_observation
        for e in result.all_events
        if e.event_type_value == "ASSET_OBSERVATION"
    ]
    assert [o.metadata["shards_done"].value for o in obs] == [1, 2, 3]
    mat = result.asset_materializations_for_node("cluster_ray_distill__teacher_generations")[0]
    # the driver's own figures (it counted the job's 23 prompts), through Pipes and through the summary file on the
    # shared volume, which the launcher reads back
    assert mat.metadata["rows"].value == 23 and mat.metadata["ray_job"].value == rj["metadata"]["name"]
    assert mat.metadata["summary_rows"].value == 23
    # the job file the driver read is on the shared volume; the submitter's plain lines are in a log file there
    workdir = Path(spec.kubernetes.artifacts.mount_path) / spec.name / "teacher_generations" / "k1"
    assert json.loads((workdir / "ray_job.json").read_text()) == job
    (log_file,) = workdir.glob("*.log")
    assert "driver: exiting" in log_file.read_text() and "__dagster_pipes_version" not in log_file.read_text()
    # everything deleted: the RayJob by the launcher, its pods with it
    assert gone and _rayjobs(api_server) == [] and _pods(api_server) == []
    haystacks = {
        "rayjob": json.dumps(operator.created),
        "event log": "\n".join(map(str, instance.all_logs(result.run_id))),
        "files": "\n".join(p.read_text(errors="replace") for p in workdir.rglob("*") if p.is_file()),
        "api requests": "\n".join(
            r.body.decode(errors="replace") for r in api_server.handler._requests if "/secrets" not in r.url.path
        ),
    }
    assert "huggingface" in haystacks["rayjob"] and "shard 1/3" in haystacks["event log"]  # real haystacks
    for where, text in haystacks.items():
        assert PLANTED not in text, f"secret value leaked into {where}"


def test_driver_failure_fails_with_the_submitters_last_lines(api_server, spec, tmp_path, monkeypatch):
    _plant_secret(api_server)
    with FakeKubeRayOperator(api_server, driver_program(DRIVER)) as operator:
        result, _, _ = _run(spec, _job(spec, tmp_path, fail=True), api_server, tmp_path, monkeypatch)
        gone = operator.wait_all_deleted()
    data = _failure(result)
    assert data.metadata["role"].value == "submitter" and data.metadata["exit_code"].value == 1
    assert "ShardFailed: shard 3 failed on worker node 10.0.0.7" in data.description
    assert gone and _rayjobs(api_server) == [] and _pods(api_server) == []


def test_missing_secret_fails_at_once_naming_the_head(api_server, spec, tmp_path, monkeypatch):
    # no Secret planted: the kubelet cannot build the Ray containers' environment
    with FakeKubeRayOperator(api_server, driver_program(DRIVER)) as operator:
        result, _, seconds = _run(spec, _job(spec, tmp_path), api_server, tmp_path, monkeypatch)
        gone = operator.wait_all_deleted()
    data = _failure(result)
    assert data.metadata["reason"].value == "CreateContainerConfigError"
    assert 'secret "huggingface" not found' in data.description and data.metadata["role"].value in ("head", "worker")
    assert gone and _rayjobs(api_server) == []


def test_unschedulable_worker_times_out(api_server, spec, tmp_path, monkeypatch):
    _plant_secret(api_server)
    stuck = {
        "worker-2": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                }
            ],
        }
    }
    with FakeKubeRayOperator(api_server, driver_program(DRIVER), pending=stuck) as operator:
        result, _, seconds = _run(
            spec, _job(spec, tmp_path, shards=FAR), api_server, tmp_path, monkeypatch, pending_timeout_s=1.0
        )
        gone = operator.wait_all_deleted()
    data = _failure(result)
    assert data.metadata["reason"].value == "Unschedulable" and "Insufficient nvidia.com/gpu" in data.description
    assert data.metadata["role"].value == "worker" and seconds < FAST_S  # the driver alone would run ~200 s
    assert gone and _rayjobs(api_server) == [] and _pods(api_server) == []


def test_cancelled_run_deletes_the_rayjob(api_server, spec, tmp_path, monkeypatch):
    _plant_secret(api_server)
    inner = driver_program(DRIVER)

    def driver(p):
        def cancel():  # once the driver has finished a shard, the run is cancelled (SIGTERM -> an interrupt)
            while not any("shard 1/" in line for line in api_server.logs.get(p.pod, [])):
                time.sleep(0.02)
            _thread.interrupt_main()

        threading.Thread(target=cancel, daemon=True).start()
        return inner(p)

    with FakeKubeRayOperator(api_server, driver) as operator:
        try:
            result, _, _ = _run(spec, _job(spec, tmp_path, shards=400), api_server, tmp_path, monkeypatch)
            interrupted = not result.success
        except KeyboardInterrupt:
            interrupted = True
        gone = operator.wait_all_deleted()
    assert interrupted and gone and _rayjobs(api_server) == [] and _pods(api_server) == []
    assert operator.jobs and all(not j["results"] for j in operator.jobs.values())  # stopped, not finished


def test_budget_stop_deletes_the_rayjob(api_server, spec, tmp_path, monkeypatch):
    _plant_secret(api_server)

    class Budget:  # the guard's interface: check() raises the budget stop once the spend passes the cap
        checks = 0

        def check(self):
            Budget.checks += 1
            if Budget.checks >= 5:
                raise Failure("budget: stopped teacher_generations mid-way")

    with FakeKubeRayOperator(api_server, driver_program(DRIVER)) as operator:
        result, instance, seconds = _run(
            spec, _job(spec, tmp_path, shards=FAR), api_server, tmp_path, monkeypatch, budget=Budget()
        )
        gone = operator.wait_all_deleted()
    assert "budget: stopped teacher_generations mid-way" in _failure(result).description and seconds < FAST_S
    assert any(
        "budget: stopping RayJob ray-cluster-ray-dist-gen-" in r.user_message for r in instance.all_logs(result.run_id)
    )
    assert gone and _rayjobs(api_server) == [] and _pods(api_server) == []


@pytest.mark.parametrize("planned_usd", [0.1, 5.0])
def test_each_finished_shard_is_charged_to_the_guard_and_a_budget_stop_deletes_the_rayjob(
    api_server, spec, tmp_path, monkeypatch, planned_usd
):
    """The driver's ``ray_shard`` messages (one per finished shard: tokens, seconds) are charged to the stage's real
    budget guard as they arrive: once the next shard would cross the budget the RayJob is deleted mid-stage and the
    spend so far is in the ledger as interrupted. Its ``ray_plan`` message (the uncached share, once the cache is
    looked up) checks the guard's planner estimate: an estimate over the budget stops the job before any shard."""
    from campaign_orchestrator.costs.budget import BudgetGuard, Limit
    from campaign_orchestrator.costs.ledger import Ledger
    from stages.errors import BudgetStopped

    _plant_secret(api_server)
    ledger = Ledger(tmp_path / "ledger.duckdb")

    def priced(u):  # $1 per 1000 completion tokens: each fake shard (50 tokens) costs $0.05
        return [
            {
                "kind": "teacher",
                "price_key": "api:output",
                "quantity": u.completion_tokens,
                "unit": "token",
                "unit_price": 0.001,
                "usd": u.completion_tokens * 0.001,
            }
        ]

    guard = BudgetGuard(
        ledger=ledger,
        campaign=spec.name,
        stage="teacher_generations",
        run_id="r1",
        step_key="s",
        attempt=0,
        stage_key="k1",
        limits=[Limit(f"campaign {spec.name}", 0.475, 0.0)],
        metered=priced,
        on_exceeded=BudgetStopped,
        log=print,
    )
    guard.planned_usd = planned_usd
    with FakeKubeRayOperator(api_server, driver_program(DRIVER)) as operator:
        result, instance, seconds = _run(
            spec, _job(spec, tmp_path, shards=FAR, fake_usage=True), api_server, tmp_path, monkeypatch, budget=guard
        )
        gone = operator.wait_all_deleted()
    why = _failure(result).description
    assert seconds < FAST_S and gone and _rayjobs(api_server) == [] and _pods(api_server) == []
    assert any(
        "budget: stopping RayJob ray-cluster-ray-dist-gen-" in r.user_message for r in instance.all_logs(result.run_id)
    )
    if planned_usd > 0.475:
        assert "not starting teacher_generations" in why and guard.usage.items == 0
        return
    assert "budget: stopped teacher_generations mid-way" in why
    # after the ninth shard ($0.45) one more like it would cross $0.475: stopped there, not at the end of the 400
    assert (guard.usage.items, guard.usage.completion_tokens, guard.usage.seconds) == (90, 450, pytest.approx(4.5))
    assert ledger.query("SELECT status, usd FROM cost_lines") == [{"status": "interrupted", "usd": pytest.approx(0.45)}]


def test_long_lived_cluster_runs_only_a_submitter(api_server, spec, tmp_path, monkeypatch):
    _plant_secret(api_server)
    raw = spec.model_dump(mode="json", exclude_none=True)
    raw["execution"]["kuberay"] = {"ray_cluster": "shared-ray"}
    shared = parse_campaign_text(yaml.safe_dump(raw), "cluster_ray.yaml")
    with FakeKubeRayOperator(api_server, driver_program("import os; os.environ['HF_TOKEN'] = 'x'\n" + DRIVER)) as op:
        result, _, _ = _run(shared, _job(shared, tmp_path), api_server, tmp_path, monkeypatch)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    (rj,) = op.created
    assert rj["spec"]["clusterSelector"] == {"ray.io/cluster": "shared-ray"} and "rayClusterSpec" not in rj["spec"]
    assert _rayjobs(api_server) == []


def test_paths_off_the_shared_volume_fail_before_creating_anything(api_server, spec, tmp_path, monkeypatch):
    job = _job(spec, tmp_path) | {"prompts": "/elsewhere/prompts.parquet"}
    job["cache"] = {"store_url": "s3://bucket/cache", "spool_dir": str(tmp_path / "artifacts" / "spool")}
    assert job_paths(job) == {
        "prompts": "/elsewhere/prompts.parquet",
        "output": job["output"],
        "cache.spool_dir": job["cache"]["spool_dir"],
    }  # an s3:// store needs no volume
    with FakeKubeRayOperator(api_server, driver_program(DRIVER)) as operator:
        result, _, _ = _run(spec, job, api_server, tmp_path, monkeypatch)
    assert "the Ray pods cannot see prompts=/elsewhere/prompts.parquet" in _failure(result).description
    assert operator.created == []


def test_the_models_a_job_loads_must_lie_on_a_volume_the_pods_mount(spec):
    """A worker loads the teacher checkpoint (a backend recipe's ``model_path``) or an answering model's base and
    adapter (``generator.model_dir`` / ``adapter_dir``): they are checked like the job's other paths."""
    from campaign_orchestrator.generation.factories import BackendFactory, LocalModelFactory
    from campaign_orchestrator.generation.scaleout.job import AnswerFactory, recipe_to_json
    from resources.k8s import manifests as mf

    root = spec.kubernetes.artifacts.mount_path
    teacher = recipe_to_json(BackendFactory(spec.teacher, "/models/teacher", "w1"))
    answer = recipe_to_json(AnswerFactory(LocalModelFactory(f"{root}/models/base", "/tmp/adapter"), "id"))
    assert job_paths({"recipe": teacher}) == {"recipe.model_path": "/models/teacher"}
    assert job_paths({"recipe": answer}) == {
        "recipe.generator.model_dir": f"{root}/models/base",
        "recipe.generator.adapter_dir": "/tmp/adapter",
    }
    assert mf.unreachable_paths(job_paths({"recipe": answer}), spec.kubernetes) == [
        "recipe.generator.adapter_dir=/tmp/adapter"
    ]
    hub = recipe_to_json(BackendFactory(spec.teacher, None, None))  # a hub id vLLM downloads itself: no path
    assert job_paths({"recipe": hub}) == {}


def test_reaper_deletes_a_dead_runs_rayjob_by_its_run_label(api_server, spec, tmp_path):
    """The process that launched the RayJob died: ``delete_run_workloads`` (the stale-run reaper's call) deletes the
    dead run's RayJob by its ``dagster/run-id`` label and leaves another run's RayJob alone."""
    from kubernetes import client

    from resources.k8s import kuberay as kr
    from resources.k8s.launcher import delete_run_workloads

    custom = client.CustomObjectsApi(api_server.api())
    for run in ("dead-run-0001", "live-run-0002"):
        w = kr.RayWorkload(
            spec=spec,
            stage="teacher_generations",
            job_file="/x/ray_job.json",
            name=kr.rayjob_name(spec.name, "teacher_generations", run, "abcde"),
            run_id=run,
        )
        custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, kr.ray_job(w))
    where = {"namespace": NS, "kubeconfig_file": str(api_server.write_kubeconfig(tmp_path / "kubeconfig"))}
    assert delete_run_workloads(where, "dead-run-0001") == ["RayJob/ray-cluster-ray-dist-gen-deadrun0-abcde"]
    assert _rayjobs(api_server) == ["ray-cluster-ray-dist-gen-liverun0-abcde"]
