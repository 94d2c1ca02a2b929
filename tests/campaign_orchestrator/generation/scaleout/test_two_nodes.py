"""A two-node Ray cluster on this machine (``ray start --head`` and a second ``ray start --address``, one CPU
each): both nodes do shards; the second node is SIGKILLed (its raylet and workers) mid-stage and the stage
finishes on the first, the lost shard redone and only its in-flight prompts asked again (test server counts)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from campaign_orchestrator.generation.factories import BackendFactory
from campaign_orchestrator.generation.requests import Sampling, namespace
from campaign_orchestrator.generation.scaleout.pool import ShardPool
from campaign_orchestrator.generation.scaleout.worker import CacheConfig
from campaigns.spec import TeacherSpec
from tests.support.processes import wait_for
from tests.support.ray_support import on_ray
from tests.support.testserver import ServerConfig, ServerThread

pytestmark = pytest.mark.slow

S = Sampling(max_new_tokens=8)
N = 64  # prompts: 8 shards of 8, about a second each (0.25 s latency, 2 in flight per worker)
RAY = shutil.which("ray", path=os.path.dirname(sys.executable))


def _on_ray(prompts, recipe, ident, cfg, execution, budget=None, **executor):
    return on_ray(prompts, S, recipe, ident, cfg, execution, budget=budget, **executor)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(p: subprocess.Popen) -> list:
    import psutil

    try:
        root = psutil.Process(p.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_tree(p: subprocess.Popen) -> None:
    import psutil

    for proc in reversed(_tree(p)):
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    p.wait(30)


@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    """Head and second node, each ``ray start --block`` in a process of its own (their daemons are its
    descendants): stopped by killing those process trees, never with ``ray stop`` (other Ray users here)."""
    # token auth (Ray's default for local clusters, the token in ~/.ray/auth_token) for the nodes and this driver alike
    # (set before ray is imported): a process that already used a cluster with token auth cannot use one without it
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    ray = pytest.importorskip("ray")
    if RAY is None:
        pytest.skip("the ray command is not installed beside this python")
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.getcwd(),
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_failure_threshold": "3",
        "RAY_health_check_initial_delay_ms": "0",
    }
    nodes = []
    short = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # Ray's socket paths must stay under 107 bytes
    try:
        head = subprocess.Popen(
            [
                RAY,
                "start",
                "--head",
                "--port",
                str(port),
                "--num-cpus",
                "1",
                "--block",
                "--include-dashboard=false",
                f"--temp-dir={short / 'h'}",
            ],
            env=env,
            stdout=(tmp_path / "head.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        nodes.append(head)
        address = f"127.0.0.1:{port}"
        wait_for(
            lambda: "Ray runtime started" in (tmp_path / "head.log").read_text() or head.poll() is not None,
            120,
            "the head node",
        )
        assert head.poll() is None, (tmp_path / "head.log").read_text()
        second = subprocess.Popen(
            [RAY, "start", "--address", address, "--num-cpus", "1", "--block", f"--temp-dir={short / 'w'}"],
            env=env,
            stdout=(tmp_path / "second.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        nodes.append(second)
        ray.init(address=address, log_to_driver=False)
        wait_for(
            lambda: sum(n["Alive"] for n in ray.nodes()) == 2 or second.poll() is not None,
            120,
            "the second node to join",
        )
        assert second.poll() is None, (tmp_path / "second.log").read_text()
        yield ray, head, second
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(nodes):
            _kill_tree(p)
        shutil.rmtree(short, ignore_errors=True)


def test_both_nodes_do_shards_and_a_lost_node_s_shards_are_redone(two_nodes, tmp_path):
    ray, head, second = two_nodes
    second_node = next(
        n["NodeID"]
        for n in ray.nodes()
        if n["Alive"] and n["NodeManagerPort"] and n["NodeID"] != ray.get_runtime_context().get_node_id()
    )
    prompts = [{"id": str(i), "prompt": f"encode w{chr(97 + i % 26)}{chr(97 + i // 26)} ="} for i in range(N)]
    with ServerThread(ServerConfig(latency_s=0.25)) as srv:
        spec = TeacherSpec(
            backend="openai", model="teacher", base_url=srv.base_url, price="unpriced", max_concurrency=2
        )
        recipe = BackendFactory(spec)
        ident = recipe.build().identity
        cfg = CacheConfig(str(tmp_path / "store"), namespace(ident, S), str(tmp_path / "spool"))
        ex = SimpleNamespace(
            replicas=2,
            num_cpus_per_replica=1.0,
            num_gpus_per_replica=0.0,
            shard_prompts=8,
            max_shard_retries=2,
            ray_address=None,
        )
        pool = ShardPool(replicas=2, num_cpus=1.0, max_shard_retries=2, start_timeout_s=120, log=print)
        # both workers up first (one per node: one CPU each), so the stage below starts on both nodes at once
        warm = [{"id": "w0", "prompt": "encode zz ="}, {"id": "w1", "prompt": "encode yy ="}]
        _on_ray(warm, recipe, ident, cfg, SimpleNamespace(**(vars(ex) | {"shard_prompts": 1})), pool=pool)
        assert {ray.get(w.ready.remote(), timeout=120)["node_id"] for w in pool.workers} == {
            n["NodeID"] for n in ray.nodes() if n["Alive"]
        }
        srv.stats.received_by_prompt.clear()
        done_on: list[str] = []
        box: dict = {}

        def stage():
            try:
                box["out"] = _on_ray(
                    prompts, recipe, ident, cfg, ex, pool=pool, on_shard=lambda rep, run: done_on.append(rep.worker)
                )
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        th = threading.Thread(target=stage)
        th.start()
        try:

            def second_mid_shard():  # the second node finished a shard and is part-way through another
                for w, where in list(pool.where.items()):
                    if where.get("node_id") != second_node or not any(where["actor_id"][:8] in d for d in done_on):
                        continue
                    try:
                        p = ray.get(w.progress.remote(), timeout=5)
                    except Exception:  # noqa: BLE001
                        continue
                    if p and 2 <= p["generated"] <= p["to_ask"] - 2:
                        return p
                return None

            lost = wait_for(second_mid_shard, 120, "the second node part-way through its second shard", every_s=0.02)
            _kill_tree(second)  # the node: its raylet, its workers, everything under its `ray start`
            th.join(240)
        finally:
            th.join(240)
            pool.close()
        assert "error" not in box, box.get("error")
        res, run = box["out"]
        stats = srv.stats.as_dict()

    assert len(res.rows) == N and not any(r["error"] for r in res.rows) and res.stats.generated == N
    assert len(run.nodes) == 2  # both nodes finished shards
    assert [x["shard"] for x in run.lost_workers] == [lost["shard"]]
    assert run.lost_workers[0]["worker"]["node_id"] == second_node
    redone = next(s for s in run.shards if s.id == lost["shard"])
    assert redone.attempts == 2 and second_node[:8] not in redone.worker  # redone on the surviving node
    asked = stats["received_by_prompt"]
    twice = [p for p, n in asked.items() if n > 1]
    assert len(asked) == N and len(twice) <= 3, twice  # the lost node's in-flight prompts, no more
