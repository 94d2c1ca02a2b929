"""The teacher stage launched as a KubeRay RayJob, end to end: a shrunken demo campaign with ``execution.kuberay`` and
a ``kubernetes:`` section is materialized through Dagster against the emulated Kubernetes API (kmock) with the fake
KubeRay operator (tests/support/kuberay_fake.py), whose driver runs the REAL entry point (``python -m
campaign_orchestrator.generation.scaleout``, unmodified: ``--address auto``) on a real Ray cluster: a head node started
here
with ``ray start --head`` (what a KubeRay head pod runs; its address in ``RAY_ADDRESS``, as KubeRay sets it in the
head's environment), the demo teacher in a Ray worker. The stage's answers equal the in-process stage's; the RayJob
carries the campaign's labels and is deleted at the end; the manifest and metadata carry the shards done/total;
every cost line (manifest and ledger) names its shard; the driver's per-shard messages reach the launcher; a
Secret's value never leaves the pods' environment."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dagster import DagsterInstance, materialize

from assets import prompts as prompts_asset
from assets import teacher_generations as generations
from assets.location import default_resources
from campaign_orchestrator.costs.ledger import Ledger
from campaigns.loader import load_campaign_file
from resources.k8s.kuberay_launcher import KubeRayJobLauncher
from tests.support import REPO_ROOT
from tests.support.campaign_support import demo_teacher, write_campaign
from tests.support.k8s_fake_cluster import NS, EmulatedApiServer
from tests.support.kuberay_fake import GROUP, PLURAL, VERSION, FakeKubeRayOperator, driver_program
from tests.support.processes import wait_for

pytestmark = pytest.mark.slow

PLANTED = "hf_PLANTED_kuberay_stage_5e8a1c"  # only in a Kubernetes Secret (the pods' HF_TOKEN) and this process's env
RAY = shutil.which("ray", path=os.path.dirname(sys.executable))


def driver(address: str) -> str:
    """The submitter's command: ``python -m campaign_orchestrator.generation.scaleout`` in the head's environment (the
    Ray
    address, and the token auth the head was started with)."""
    return (
        f"import os, runpy\nos.environ.update(RAY_ADDRESS={address!r}, RAY_AUTH_MODE='token')\n"
        "runpy.run_module('campaign_orchestrator.generation.scaleout', run_name='__main__', alter_sys=True)\n"
    )


SEEN: list[dict] = []  # the driver's ray_shard messages as the launcher handed them to the stage


class RecordingLauncher(KubeRayJobLauncher):
    """The launcher as shipped, noting the per-shard messages it charges and passes on."""

    def launch(self, context, spec, stage, job, workdir, budget=None, on_shard=None):
        def note(msg):
            SEEN.append(msg)
            if on_shard is not None:
                on_shard(msg)

        return super().launch(context, spec, stage, job, workdir, budget=budget, on_shard=note)


@contextmanager
def ray_head(tmp_path):
    """A Ray head node in a process of its own (``ray start --head --block``, 2 CPUs, no dashboard), started at once
    and waited for by calling the yielded function; its process tree is killed at the end (never ``ray stop``: other
    Ray users here). Its workers run at normal priority: Ray's default nice 15 starves them on a busy shared host."""
    import psutil

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    short = Path(tempfile.mkdtemp(prefix="rk", dir="/tmp"))  # Ray's socket paths must stay under 107 bytes
    log = tmp_path / "ray_head.log"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RAY_AUTH_MODE": "token", "RAY_worker_niceness": "0"}
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--block",
            "--include-dashboard=false",
            f"--temp-dir={short}",
        ],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )

    def ready() -> str:
        wait_for(lambda: "Ray runtime started" in log.read_text() or head.poll() is not None, 180, "the Ray head")
        assert head.poll() is None, log.read_text()
        return f"127.0.0.1:{port}"

    try:
        yield ready
    finally:
        procs = [head]
        try:
            procs = [psutil.Process(head.pid), *psutil.Process(head.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
        for proc in reversed(procs):
            try:
                proc.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        head.wait(30)
        shutil.rmtree(short, ignore_errors=True)


def _spec(tmp_path, root, kuberay: bool):
    sections = {"cost": {"budget_usd": 100.0, "check_estimates": False}}  # a metered guard, charged per shard
    if kuberay:
        sections |= {
            "execution": {
                "executor": "ray",
                "replicas": 1,
                "num_cpus_per_replica": 1,
                "shard_prompts": 8,
                "kuberay": {"ray_version": "2.60.0"},
            },
            "kubernetes": {
                "namespace": NS,
                "image": "example/campaign-orchestrator:test",
                "artifacts": {"claim": "campaign-artifacts", "mount_path": str(root)},
                "labels": {"team": "ml-platform"},
                "secret_env": [{"name": "HF_TOKEN", "secret": "huggingface", "key": "token"}],
            },
        }
    path = write_campaign(tmp_path / ("kuberay" if kuberay else "local"), "kr", demo_teacher(), prompts=30, **sections)
    return load_campaign_file(path)


def _materialize(spec, root, **resources):
    instance = DagsterInstance.ephemeral()
    result = materialize(
        [prompts_asset.build(spec), generations.build(spec)],
        instance=instance,
        resources=default_resources(str(root)) | resources,
        raise_on_error=False,
    )
    return result, instance


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


def _metadata(result) -> dict:
    (mat,) = result.asset_materializations_for_node("kr__teacher_generations")
    return {k: v.value for k, v in mat.metadata.items()}


@pytest.mark.skipif(RAY is None, reason="the ray command is not installed beside this python")
def test_the_teacher_stage_runs_as_a_rayjob_with_the_in_process_answers(tmp_path, artifact_root, monkeypatch):
    t0 = time.monotonic()
    with ray_head(tmp_path) as head:  # starting while the in-process stage runs
        monkeypatch.setenv("HF_TOKEN", PLANTED)  # in the Dagster process too: it must not leak from there either
        _run_both(tmp_path, artifact_root, head)
    print(f"wall {time.monotonic() - t0:.1f} s")


def _run_both(tmp_path, artifact_root, head):
    local, _ = _materialize(_spec(tmp_path, artifact_root, kuberay=False), artifact_root)
    assert local.success, [e.message for e in local.all_events if e.is_failure]
    stage_root = artifact_root / "kr" / "teacher_generations"
    l_dir = Path(json.loads((stage_root / "LATEST.json").read_text())["path"])
    l_rows = pq.read_table(l_dir / "generations.parquet").to_pylist()
    shutil.rmtree(stage_root)  # the same stage again, from nothing: on the RayJob's cluster
    shutil.rmtree(artifact_root / "cache")

    spec = _spec(tmp_path, artifact_root, kuberay=True)
    SEEN.clear()
    with EmulatedApiServer() as server:
        _plant_secret(server)
        launcher = RecordingLauncher(
            kubeconfig_file=str(server.write_kubeconfig(tmp_path / "kubeconfig")),
            poll_interval_s=0.5,
            log_drain_timeout_s=20,
        )
        with FakeKubeRayOperator(server, driver_program(driver(head()), timeout_s=240)) as operator:
            operator.reconcile_s = 0.2  # the CPUs are for Ray and the model here
            result, instance = _materialize(spec, artifact_root, kuberay=launcher)
            gone = operator.wait_all_deleted(10)
        from kubernetes import client

        left = client.CustomObjectsApi(server.api()).list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"]
    assert result.success, [e.message for e in result.all_events if e.is_failure]

    # the answers of the in-process stage, from the RayJob's cluster, none from the cache
    k_dir = Path(json.loads((stage_root / "LATEST.json").read_text())["path"])
    assert k_dir == l_dir  # the same stage output (its key does not depend on where it ran)
    k_rows = pq.read_table(k_dir / "generations.parquet").to_pylist()
    assert len(k_rows) == len(l_rows) >= 20
    assert [(r["id"], r["sample_index"], r["completion"]) for r in k_rows] == [
        (r["id"], r["sample_index"], r["completion"]) for r in l_rows
    ]
    assert not any(r["from_cache"] for r in k_rows)

    # one RayJob, the campaign's labels, created by this run and deleted at its end (its pods with it)
    (rj,) = operator.created
    labels = rj["metadata"]["labels"]
    assert (labels["dagster/campaign"], labels["dagster/run-id"]) == ("kr", result.run_id)
    assert labels["team"] == "ml-platform"  # kubernetes.labels
    assert labels["dagster/asset-key"] == "kr.teacher_generations"
    assert f"--job {k_dir}/ray/ray_job.json" in rj["spec"]["entrypoint"]
    assert gone and left == []

    # shards done/total in the manifest and the metadata; the driver's per-shard messages reached the launcher
    man = json.loads((k_dir / "manifest.json").read_text())
    ray, md = man["ray"], _metadata(result)
    n = ray["shards_total"]
    assert n == -(-len(k_rows) // 8) and ray["shards_done"] == n and md["shards"] == f"{n}/{n}"
    shard_ids = {s["id"] for s in ray["shards"]}
    assert {m["shard"] for m in SEEN} == shard_ids and sum(m["generated"] for m in SEEN) == len(k_rows)
    assert [m["final"] for m in SEEN] == [False] * (n - 1) + [True]
    assert md["new_generations"] == len(k_rows) and md["cache_hits"] == 0

    # every cost line names its shard, priced on the Dagster side as on a local cluster; the ledger keeps the id
    assert man["cost_lines"] and {x["shard"] for x in man["cost_lines"]} == shard_ids
    assert all(x["usd"] > 0 and x["kind"] == "teacher" for x in man["cost_lines"])
    ledger = Ledger(artifact_root / "cost_ledger.duckdb").query(
        "SELECT shard, usd FROM cost_lines WHERE campaign = 'kr' AND asset = 'teacher_generations' AND run_id = ?",
        [result.run_id],
    )
    assert {r["shard"] for r in ledger} == shard_ids
    assert sum(r["usd"] for r in ledger) == pytest.approx(sum(x["usd"] for x in man["cost_lines"]))

    # the job's files on the shared volume: its JOB.json and summary, the submitter's log; the secret nowhere
    (log_file,) = (k_dir / "ray").glob("*.log")
    logs = [r.user_message for r in instance.all_logs(result.run_id)]
    haystacks = {
        "rayjob": json.dumps(operator.created),
        "event log": "\n".join(logs),
        "metadata": json.dumps(md, default=str),
        "files": "\n".join(
            p.read_text(errors="replace")
            for p in (artifact_root / "kr").rglob("*")
            if p.is_file() and p.suffix in (".json", ".log", ".txt")
        ),
    }
    assert "huggingface" in haystacks["rayjob"] and "shard" in log_file.read_text()  # real haystacks
    assert any(f"RayJob {rj['metadata']['name']} finished" in m for m in logs)
    for where, text in haystacks.items():
        assert PLANTED not in text, f"secret value leaked into {where}"
