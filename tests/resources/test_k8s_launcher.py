"""The Kubernetes launcher's whole lifecycle against an emulated API server (kmock over HTTP).

The real ``student_adapter`` asset of ``campaigns/examples/cluster.yaml`` (2 nodes x 8 GPUs,
hybrid sharding, ``launcher: k8s``) is materialized by Dagster; the launcher creates the Service
and the Indexed Job through the Kubernetes client, a fake kubelet (tests/support/k8s_fake_cluster.py)
runs one pod per node, rank 0 talks back through real Dagster Pipes messages in its pod log, and
the launcher streams them into the asset, fails fast on a dead pod and deletes what it created.
"""

from __future__ import annotations

import _thread
import base64
import json
import time
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, AssetsDefinition, DagsterInstance, asset, materialize

from assets import student_adapter as adapter
from campaigns.loader import parse_campaign_text
from resources import run_owner
from resources.k8s import K8sTrainingLauncher
from resources.local_launcher import LocalTorchrunLauncher
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from resources.training_launcher import TrainingLauncher
from tests.support import REPO_ROOT
from tests.support.k8s_fake_cluster import NS, EmulatedApiServer, FakeKubelet, python_program, scripted_program

PLANTED = "hf_PLANTED_SECRET_value_7f3a9c"  # lives only in a Kubernetes Secret and the Dagster process env
# "Fails fast" tells a stopped job from one left to run: rank 0 would take FAR steps of 0.05 s (~200 s), ten times
# the bound, so a loaded host (which slows the Dagster run around the job, not the job's sleeps) cannot bridge it.
FAR, FAST_S = "4000", 100

# Rank 0's stand-in for `python -m training`: the real training.reporting.Reporter over the pod's env.
TRAINER = r"""
import json, os, sys, time
from pathlib import Path
from training.reporting import Reporter
job = json.loads(Path(sys.argv[1]).read_text())
node = int(os.environ["NODE_RANK"])
assert os.environ.get("HF_TOKEN"), "secretKeyRef was not resolved"
r = Reporter(is_main=node == 0)
print(f"node {node}: torchrun world {job['training']['nodes']}x{job['training']['processes_per_node']}, "
      f"sharding {job['training']['sharding']}, NCCL_SOCKET_IFNAME={os.environ['NCCL_SOCKET_IFNAME']}", flush=True)
steps = int(os.environ["FAKE_STEPS"])
for step in range(1, steps + 1):
    r.log(f"step {step}/{steps} loss {2.0 / step:.4f}")
    r.metrics({"step": step, "loss": 2.0 / step, "tokens_per_s": 1000.0 * step})
    time.sleep(float(os.environ["FAKE_STEP_S"]))
if node == 0:
    summary = {"steps": steps, "first_loss": 2.0, "final_loss": 2.0 / steps, "tokens": 4096, "tokens_per_s": 1000.0,
               "train_seconds": 0.5, "world_size": 16, "effective_batch": 128, "trainable_parameters": 1000,
               "adapter_bytes": 4000, "peak_memory_mb": 1.0, "device": "cuda"}  # a GPU pod, as the trainer reports
    Path(job["output_dir"], "summary.json").write_text(json.dumps(summary))
    r.materialization({"steps": steps, "final_loss": 2.0 / steps})
    r.log("done")
print(f"node {node}: exiting", flush=True)
r.close()
"""


@pytest.fixture
def api_server():
    with EmulatedApiServer() as server:
        yield server


@pytest.fixture
def artifact_root(tmp_path) -> Path:
    """The shared volume: an artifact root holding a base checkpoint (the pods never load it here)."""
    root = tmp_path / "artifacts"
    (root / "models" / "student").mkdir(parents=True)
    (root / "models" / "student" / "config.json").write_text('{"model_type": "llama"}')
    return root


@pytest.fixture
def cluster_spec(artifact_root):
    raw = yaml.safe_load((REPO_ROOT / "campaigns/examples/cluster.yaml").read_text())
    raw["student"]["base_model"] = str(artifact_root / "models" / "student")
    k = raw["kubernetes"]
    k["artifacts"]["mount_path"] = str(artifact_root)  # the shared volume = this test's artifact root
    k["secret_env"] = [{"name": "HF_TOKEN", "secret": "huggingface", "key": "token"}]
    k["env"].update({"FAKE_STEPS": "3", "FAKE_STEP_S": "0.05"})
    return parse_campaign_text(yaml.safe_dump(raw), "cluster.yaml")


def _plant_secret(server: EmulatedApiServer) -> None:
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


def _run_adapter(spec, artifact_root: Path, server: EmulatedApiServer, tmp_path: Path, monkeypatch, **launcher_kw):
    """Materialize the real student_adapter asset (its dataset input stubbed) with the k8s launcher."""
    monkeypatch.setenv("HF_TOKEN", PLANTED)  # in the Dagster process too: it must not leak from there either
    data = artifact_root / spec.name / "tokenized_dataset" / "stub"
    data.mkdir(parents=True)

    @asset(key=AssetKey([spec.name, "tokenized_dataset"]), group_name=spec.name)
    def tokenized_dataset() -> dict:
        return {"dataset_path": str(data), "key": "stub-dataset", "path": str(data)}

    adapter_asset: AssetsDefinition = adapter.build(spec)
    k8s = K8sTrainingLauncher(
        kubeconfig_file=str(server.write_kubeconfig(tmp_path / "kubeconfig")),
        poll_interval_s=0.1,
        log_drain_timeout_s=10,
        **launcher_kw,
    )
    from assets.io_manager import ManifestIOManager

    instance = DagsterInstance.ephemeral()
    t0 = time.monotonic()
    result = materialize(
        [tokenized_dataset, adapter_asset],
        instance=instance,
        raise_on_error=False,
        resources={
            "storage": ArtifactStore(root=str(artifact_root)),
            "io_manager": ManifestIOManager(root=str(artifact_root)),
            "launcher": TrainingLauncher(local=LocalTorchrunLauncher(), k8s=k8s),
            "pricing": PricingResource(),
        },
    )
    return result, instance, time.monotonic() - t0


def _live(server: EmulatedApiServer, kind: str) -> list[str]:
    from kubernetes import client

    api = server.api()
    if kind == "jobs":
        items = client.BatchV1Api(api).list_namespaced_job(NS).items
    elif kind == "services":
        items = client.CoreV1Api(api).list_namespaced_service(NS).items
    else:
        items = client.CoreV1Api(api).list_namespaced_pod(NS).items
    return [i.metadata.name for i in items]


def _failure(result):
    ev = next(e for e in result.all_events if e.is_step_failure)
    return ev.step_failure_data.user_failure_data, ev.step_failure_data.error


def kubelet_results(kubelet) -> dict[int, int]:
    """Exit codes of pods that ended on their own (a pod stopped by the Job's deletion has none)."""
    return {i: c for j in kubelet.jobs.values() for i, c in j["results"].items()}


def _trainer_programs(failing: dict[int, object] | None = None):
    def programs(index: int, n: int):
        if failing and index in failing:
            return failing[index]
        return python_program(TRAINER)

    return programs


def test_success_streams_rank0_messages_cleans_up_and_leaks_no_secret(
    api_server, cluster_spec, artifact_root, tmp_path, monkeypatch
):
    _plant_secret(api_server)
    with FakeKubelet(api_server, _trainer_programs()) as kubelet:
        result, instance, _ = _run_adapter(cluster_spec, artifact_root, api_server, tmp_path, monkeypatch)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    # what the launcher created: the headless Service and a 2-pod Indexed Job, labelled with the run
    (job,) = [o for o in kubelet.created if o["kind"] == "Job"]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 2
    assert job["metadata"]["labels"]["dagster/run-id"] == result.run_id
    # the run names the cluster its workloads live in: the reaper deletes them there if this process dies
    assert json.loads(instance.get_run_by_id(result.run_id).tags[run_owner.OWNER_TAG])["k8s"]["namespace"] == NS
    assert job["metadata"]["labels"]["dagster/asset-key"] == "cluster_distill.student_adapter"
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"] and cmd[-4:-1] == [
        "-m",
        "training",
        "--config",
    ]
    assert {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES"} <= {
        e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    # everything deleted after success (Job, Service; the pods garbage-collected with the Job)
    assert _live(api_server, "jobs") == [] and _live(api_server, "services") == [] and _live(api_server, "pods") == []
    # rank 0's Pipes messages streamed into the asset: logs, one observation per metrics message, materialization
    logs = [r.user_message for r in instance.all_logs(result.run_id)]
    assert any("step 3/3 loss 0.6667" in m for m in logs)
    obs = [
        e.asset_observation_data.asset_observation
        for e in result.all_events
        if e.event_type_value == "ASSET_OBSERVATION"
    ]
    assert [o.metadata["step"].value for o in obs] == [1, 2, 3]  # only rank 0 reported, once per step
    assert obs[-1].asset_key == AssetKey(["cluster_distill", "student_adapter"])
    mat = result.asset_materializations_for_node("cluster_distill__student_adapter")[0]
    assert mat.metadata["final_loss"].value == pytest.approx(2.0 / 3, abs=5e-5)  # shown to 4 figures, for people
    # both nodes' plain log lines landed in per-node log files next to the adapter
    logs_md = json.loads((artifact_root / "cluster_distill" / "student_adapter" / "LATEST.json").read_text())["logs"]
    assert [Path(p).name for p in logs_md] == ["node-0.log", "node-1.log"]
    assert "node 1: exiting" in Path(logs_md[1]).read_text()
    assert "__dagster_pipes_version" not in Path(logs_md[0]).read_text()
    _assert_secret_never_leaked(api_server, kubelet, instance, result, artifact_root)


def _assert_secret_never_leaked(api_server, kubelet, instance, result, artifact_root):
    """The token is in a Kubernetes Secret and in the Dagster process's environment; it must not appear in any
    object or request body sent to the API, the event log (messages and metadata), the node logs or job files."""
    haystacks = {
        "workload objects": json.dumps(kubelet.created),
        "api requests": "\n".join(
            r.body.decode(errors="replace") for r in api_server.handler._requests if "/secrets" not in r.url.path
        ),
        "event log": "\n".join(str(e) for e in instance.all_logs(result.run_id)),
        "files": "\n".join(p.read_text(errors="replace") for p in artifact_root.rglob("*") if p.is_file()),
    }
    # the haystacks are real: the Secret's *name* and the pipes context are in them
    assert "huggingface" in haystacks["workload objects"] and "DAGSTER_PIPES_CONTEXT" in haystacks["api requests"]
    assert "step 3/3" in haystacks["event log"] and "node 1: exiting" in haystacks["files"]
    for where, text in haystacks.items():
        assert PLANTED not in text, f"secret value leaked into {where}"


def test_failed_pod_fails_fast_with_reason_and_last_lines(
    api_server, cluster_spec, artifact_root, tmp_path, monkeypatch
):
    _plant_secret(api_server)
    oom = scripted_program(
        ["loading shard 3/8", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"],
        exit_code=137,
        reason="OOMKilled",
        delay_s=0.05,
    )
    monkeypatch.setitem(cluster_spec.kubernetes.env, "FAKE_STEPS", FAR)  # rank 0 would run ~200 s
    with FakeKubelet(api_server, _trainer_programs({1: oom})) as kubelet:
        result, _, seconds = _run_adapter(cluster_spec, artifact_root, api_server, tmp_path, monkeypatch)
        gone = kubelet.wait_all_deleted()  # the Job is gone, so its pods (and rank 0's process) are too
    assert not result.success
    data, _ = _failure(result)
    assert "OOMKilled" in data.description and "exit code 137" in data.description
    assert "(node 1)" in data.description and "CUDA out of memory" in data.description
    pod = data.metadata["pod"].value
    assert pod.startswith("train-cluster-distill-") and "-1-" in pod
    assert data.metadata["reason"].value == "OOMKilled" and data.metadata["exit_code"].value == 137
    # failed while rank 0 was still training (it never reached its last step), not after it
    rank0_log = "\n".join(v for k, lines in api_server.logs.items() if "-0-" in k for v in lines)
    assert "step 2/400" in rank0_log or "step 1/400" in rank0_log or "torchrun world" in rank0_log
    assert "step 400/400" not in rank0_log and 0 not in kubelet_results(kubelet)
    assert seconds < FAST_S, f"did not fail fast ({seconds:.1f}s); rank 0 alone would have run ~200 s"
    assert gone
    assert _live(api_server, "jobs") == [] and _live(api_server, "services") == [] and _live(api_server, "pods") == []


def test_missing_secret_fails_without_waiting(api_server, cluster_spec, artifact_root, tmp_path, monkeypatch):
    # no Secret planted: the kubelet cannot build the container's environment
    with FakeKubelet(api_server, _trainer_programs()):
        result, _, seconds = _run_adapter(cluster_spec, artifact_root, api_server, tmp_path, monkeypatch)
    data, _ = _failure(result)
    assert data.metadata["reason"].value == "CreateContainerConfigError"
    assert 'secret "huggingface" not found' in data.description
    assert _live(api_server, "jobs") == [] and _live(api_server, "services") == []


def test_unschedulable_pod_times_out(api_server, cluster_spec, artifact_root, tmp_path, monkeypatch):
    _plant_secret(api_server)
    stuck = {
        1: {
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
    monkeypatch.setitem(cluster_spec.kubernetes.env, "FAKE_STEPS", FAR)
    with FakeKubelet(api_server, _trainer_programs(), pending=stuck):
        result, _, seconds = _run_adapter(
            cluster_spec, artifact_root, api_server, tmp_path, monkeypatch, pending_timeout_s=1.0
        )
    data, _ = _failure(result)
    assert data.metadata["reason"].value == "Unschedulable" and "Insufficient nvidia.com/gpu" in data.description
    assert "(waited 1s)" in data.description or "(waited 2s)" in data.description
    assert seconds < FAST_S  # rank 0 alone would have run ~200 s
    assert _live(api_server, "jobs") == [] and _live(api_server, "services") == []


def test_cancelled_run_deletes_job_and_service(api_server, cluster_spec, artifact_root, tmp_path, monkeypatch):
    _plant_secret(api_server)
    monkeypatch.setitem(cluster_spec.kubernetes.env, "FAKE_STEPS", "400")
    cancelled = {}

    def programs(index, n):
        inner = python_program(TRAINER)

        def run(p):
            if index == 0:  # once rank 0 is training, the run is cancelled (Dagster turns SIGTERM into an interrupt)

                def cancel():
                    while not any("step 2/" in line for line in api_server.logs.get(p.pod, [])):
                        time.sleep(0.02)
                    cancelled["at"] = time.monotonic()
                    _thread.interrupt_main()

                import threading

                threading.Thread(target=cancel, daemon=True).start()
            return inner(p)

        return run

    with FakeKubelet(api_server, programs) as kubelet:
        try:
            result, _, _ = _run_adapter(cluster_spec, artifact_root, api_server, tmp_path, monkeypatch)
            interrupted = not result.success
        except KeyboardInterrupt:
            interrupted = True
        gone = kubelet.wait_all_deleted()
    assert interrupted and "at" in cancelled and gone
    assert _live(api_server, "jobs") == [] and _live(api_server, "services") == [] and _live(api_server, "pods") == []


def test_pytorchjob_lifecycle(api_server, cluster_spec, artifact_root, tmp_path, monkeypatch):
    _plant_secret(api_server)
    spec = cluster_spec.model_copy(
        update={"kubernetes": cluster_spec.kubernetes.model_copy(update={"workload": "pytorchjob"})}
    )

    def programs(index, n):
        # under the operator, NODE_RANK is not set by us: map the operator's RANK for the stand-in
        return python_program("import os; os.environ['NODE_RANK'] = os.environ.get('RANK', '0')\n" + TRAINER)

    with FakeKubelet(api_server, programs) as kubelet:
        result, _, _ = _run_adapter(spec, artifact_root, api_server, tmp_path, monkeypatch)
    (pt,) = kubelet.created
    assert pt["kind"] == "PyTorchJob" and pt["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    from kubernetes import client

    assert (
        client.CustomObjectsApi(api_server.api()).list_namespaced_custom_object(
            "kubeflow.org", "v1", NS, "pytorchjobs"
        )["items"]
        == []
    )


def _reparsed(spec, mutate):
    raw = spec.model_dump(mode="json", exclude_none=True)
    mutate(raw)
    return parse_campaign_text(yaml.safe_dump(raw), "cluster.yaml")


def test_budget_stops_a_running_job_and_deletes_it(api_server, cluster_spec, artifact_root, tmp_path, monkeypatch):
    """A tiny budget: the launcher's poll sees the spend (16 GPUs x $225/GPU-hour = $1 per second) pass it while
    the pods train, deletes the Job and Service and fails with the budget stop; the spend is in the ledger."""
    _plant_secret(api_server)
    nccl = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1}

    def mutate(raw):
        raw["cost"].update(budget_usd=4.0, check_estimates=False, overrides={"h100-sxm": 225.0})
        raw["training"]["distributed_env"] = nccl  # and out of kubernetes.env: the pods get them from here
        for name in nccl:
            raw["kubernetes"]["env"].pop(name, None)
        raw["kubernetes"]["env"].update(FAKE_STEPS=FAR)  # rank 0 would run ~200 s

    spec = _reparsed(cluster_spec, mutate)
    with FakeKubelet(api_server, _trainer_programs()) as kubelet:
        result, instance, seconds = _run_adapter(spec, artifact_root, api_server, tmp_path, monkeypatch)
        gone = kubelet.wait_all_deleted()
    assert not result.success
    data, _ = _failure(result)
    assert "budget: stopped student_adapter mid-way: campaign cluster_distill has spent $" in data.description
    assert "of its $4.000000 budget" in data.description
    assert "raise the budget and materialize again" in data.description
    spent, remaining = data.metadata["spent_usd"].value, data.metadata["remaining_usd"].value
    # stopped at the poll whose spend plus one more poll's would pass $4 (a slow poll can overshoot a little)
    assert 1.0 < spent < 6.0 and remaining == pytest.approx(max(0.0, 4.0 - spent))
    # it stopped a running job: both pods had started, got the campaign's distributed_env, and none ended by itself
    runs = [r for j in kubelet.jobs.values() for r in j["runs"]]
    assert len(runs) == 2 and kubelet_results(kubelet) == {}
    for r in runs:
        assert {k: r.env.get(k) for k in nccl} == {k: str(v) for k, v in nccl.items()}
    assert seconds < FAST_S, f"the budget did not stop the job ({seconds:.1f}s); rank 0 alone would have run ~200 s"
    # deleted by the launcher (not by the job ending): Job, Service, and the pods with the Job
    assert gone
    assert _live(api_server, "jobs") == [] and _live(api_server, "services") == [] and _live(api_server, "pods") == []
    logs = [r.user_message for r in instance.all_logs(result.run_id)]
    assert any("budget: stopping train-cluster-distill-" in m for m in logs)
    assert any("deleted Job/" in m and "Service/" in m for m in logs)
    # the stopped attempt's spend is recorded as interrupted, so the next attempt counts it
    from campaign_orchestrator.costs.ledger import Ledger

    assert Ledger(artifact_root / "cost_ledger.duckdb").spent("cluster_distill") == pytest.approx(spent, rel=1e-6)


def test_env_set_twice_fails_before_creating_anything(api_server, cluster_spec, artifact_root, tmp_path, monkeypatch):
    # kubernetes.env of the example sets NCCL_SOCKET_IFNAME; the campaign sets it under distributed_env too. A
    # campaign file with that is refused when it loads; a spec built in code is caught again by the launcher.
    tr = cluster_spec.training.model_copy(
        update={"distributed_env": type(cluster_spec.training.distributed_env)(NCCL_SOCKET_IFNAME="ib0")}
    )
    spec = cluster_spec.model_copy(update={"training": tr})
    with FakeKubelet(api_server, _trainer_programs()) as kubelet:
        result, _, _ = _run_adapter(spec, artifact_root, api_server, tmp_path, monkeypatch)
    data, _ = _failure(result)
    assert "NCCL_SOCKET_IFNAME (training.distributed_env and kubernetes.env)" in data.description
    assert "remove it from kubernetes.env" in data.description
    assert kubelet.created == [] and _live(api_server, "services") == []


def test_reaper_deletes_a_dead_runs_workloads_by_run_label_before_freeing_its_slot(
    api_server, cluster_spec, tmp_path, monkeypatch
):
    """The `campaign run` that launched on the cluster died without cleaning up (SIGKILL): its Job and Service still
    run.
    The reaper finds the cluster in the run's owner tag (``campaign/owner``: ``k8s``, what the launcher records) and
    deletes the Job and Service labelled with the dead run's id (the pods go with the Job), then frees the slot; another
    run's Job stays."""
    import subprocess
    import sys

    from dagster import DagsterRunStatus, job, op

    from assets.run_recovery import owner_tags, reap_dead_runs
    from resources.k8s import manifests as mf
    from tests.support.campaign_support import instance_home

    monkeypatch.setenv("DAGSTER_HOME", str(instance_home(tmp_path / "dagster_home")))
    kubeconfig = api_server.write_kubeconfig(tmp_path / "kubeconfig")
    owner = subprocess.Popen([sys.executable, "-c", "pass"])
    import psutil

    start = psutil.Process(owner.pid).create_time()
    owner.wait()  # the owner is gone

    @op
    def noop():
        pass

    @job
    def owned():
        noop()

    with DagsterInstance.get() as instance:
        instance.event_log_storage.set_concurrency_slots("gpu", 1)
        where = K8sTrainingLauncher(kubeconfig_file=str(kubeconfig))
        dead = instance.create_run_for_job(
            owned, status=DagsterRunStatus.STARTED, tags=owner_tags(pid=owner.pid, start=start)
        )
        live = instance.create_run_for_job(owned, status=DagsterRunStatus.STARTED, tags=owner_tags())
        from kubernetes import client

        for run in (dead, live):
            w = mf.Workload(
                campaign=cluster_spec.name,
                training=cluster_spec.training,
                cluster=cluster_spec.kubernetes,
                job_file="/x/train_job.json",
                name=mf.workload_name(cluster_spec.name, run.run_id, "abc"),
                run_id=run.run_id,
                asset_key="cluster_distill.student_adapter",
                pipes_env={},
            )
            for m in mf.build_manifests(w):
                where._create(
                    client.CoreV1Api(api_server.api()),
                    client.BatchV1Api(api_server.api()),
                    client.CustomObjectsApi(api_server.api()),
                    m,
                )
            ctx = type(
                "Ctx",
                (),
                {"instance": instance, "run_id": run.run_id, "log": type("L", (), {"debug": staticmethod(print)})()},
            )()
            where._record_cluster(ctx, NS)
        assert instance.event_log_storage.claim_concurrency_slot("gpu", dead.run_id, "noop").is_claimed
        assert len(_live(api_server, "jobs")) == 2 and len(_live(api_server, "services")) == 2
        said: list[str] = []
        assert reap_dead_runs(instance, log=said.append) == [dead.run_id]
        live_name = mf.workload_name(cluster_spec.name, live.run_id, "abc")
        assert _live(api_server, "jobs") == [live_name] and _live(api_server, "services") == [live_name]
        deleted = next(i for i, m in enumerate(said) if "deleted its Kubernetes workloads Job/" in m)
        freed = next(i for i, m in enumerate(said) if "marked failed and its pool slots freed" in m)
        assert deleted < freed and "Service/" in said[deleted]
        assert run_owner.read(instance.get_run_by_id(dead.run_id).tags)["k8s"]["namespace"] == NS
        assert not instance.event_log_storage.get_concurrency_run_ids()
