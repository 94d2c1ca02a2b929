"""A generation stage on a real local Ray cluster (one for the module) against the project's test server, which
counts the requests it gets per prompt: one worker SIGKILLed mid-shard costs only its in-flight prompts; an
engine that cannot start fails the stage naming the shard, the worker and the reason; the job's rate limits are
one set of buckets for every worker."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

import pytest

from campaign_orchestrator.generation.factories import BackendFactory
from campaign_orchestrator.generation.requests import Sampling, build_requests, namespace
from campaign_orchestrator.generation.scaleout.pool import ShardFailed, ShardPool
from campaign_orchestrator.generation.scaleout.shards import make_shards
from campaign_orchestrator.generation.scaleout.stage import RayExecutor
from campaign_orchestrator.generation.scaleout.worker import CacheConfig
from campaigns.spec import TeacherSpec
from tests.support.processes import wait_for
from tests.support.ray_support import on_ray
from tests.support.testserver import ServerConfig, ServerThread

pytestmark = pytest.mark.slow

S = Sampling(max_new_tokens=8)
CONCURRENCY = 2  # requests in flight per worker


def _on_ray(prompts, recipe, ident, cfg, execution, budget=None, **executor):
    return on_ray(prompts, S, recipe, ident, cfg, execution, budget=budget, **executor)


def _execution(**kw):
    return SimpleNamespace(
        **(
            {
                "replicas": 2,
                "num_cpus_per_replica": 0.5,
                "num_gpus_per_replica": 0.0,
                "shard_prompts": 12,
                "max_shard_retries": 2,
                "ray_address": None,
            }
            | kw
        )
    )


def _setup(tmp_path, srv, **teacher):
    spec = TeacherSpec(
        backend="openai",
        model="teacher",
        base_url=srv.base_url,
        price="unpriced",
        max_concurrency=CONCURRENCY,
        **teacher,
    )
    recipe = BackendFactory(spec)
    ident = recipe.build().identity if not teacher.get("api_key_env") else "openai:keyed"
    cfg = CacheConfig(str(tmp_path / "store"), namespace(ident, S), str(tmp_path / "spool"))
    return recipe, ident, cfg


def _prompts(n: int) -> list[dict]:
    return [{"id": str(i), "prompt": f"encode w{chr(97 + i % 26)}{chr(97 + i // 26)} ="} for i in range(n)]


def test_a_worker_killed_mid_shard_costs_only_its_in_flight_prompts(ray_cluster, tmp_path):
    with ServerThread(ServerConfig(latency_s=0.15)) as srv:
        recipe, ident, cfg = _setup(tmp_path, srv)
        ex = _execution()
        pool = ShardPool(replicas=2, num_cpus=0.5, max_shard_retries=2, log=print)
        box: dict = {}

        def stage():
            try:
                box["out"] = _on_ray(_prompts(48), recipe, ident, cfg, ex, pool=pool)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        th = threading.Thread(target=stage)
        th.start()
        try:

            def busy_worker():  # a worker part-way through a shard: some answers finished, some not yet
                for w in list(pool.workers):
                    try:
                        p = ray_cluster.get(w.progress.remote(), timeout=5)
                    except Exception:  # noqa: BLE001 - starting or gone
                        continue
                    if p and 4 <= p["generated"] <= p["to_ask"] - 3 and w in pool.where:
                        return w, p
                return None

            victim, before = wait_for(busy_worker, 120, "a worker part-way through a shard", every_s=0.02)
            os.kill(pool.where[victim]["pid"], signal.SIGKILL)
            th.join(180)
        finally:
            th.join(180)
            pool.close()
        assert "error" not in box, box.get("error")
        res, run = box["out"]
        stats = srv.stats.as_dict()

    # the stage finished: every prompt answered once in the rows, no error
    assert len(res.rows) == 48 and not any(r["error"] for r in res.rows)
    assert res.stats.generated == 48 and res.stats.cache_hits == 0
    # the lost shard was named, retried once on a fresh worker, and every other shard ran once
    assert [x["shard"] for x in run.lost_workers] == [before["shard"]]
    assert "pid" in run.lost_workers[0]["worker"] and run.lost_workers[0]["reason"]
    assert run.retried == [{"shard": before["shard"], "attempt": 2}]
    by_id = {s.id: s for s in run.shards}
    assert by_id[before["shard"]].attempts == 2 and all(s.attempts == 1 for s in run.shards if s.id != before["shard"])
    # paid twice: only what was in flight on the killed worker (its finished answers were in its spool)
    asked = stats["received_by_prompt"]
    assert len(asked) == 48 and all(n >= 1 for n in asked.values())
    twice = {p for p, n in asked.items() if n > 1}
    assert len(twice) <= CONCURRENCY + 1, twice  # in flight when killed (+1: one finished but not yet spooled)
    shard = next(
        s
        for s in make_shards(
            [r for rs in build_requests(ident, S, [p["prompt"] for p in _prompts(48)]) for r in rs], 12
        )
        if s.id == before["shard"]
    )
    assert twice <= {r.prompt for r in shard.requests}  # all of them from the killed worker's shard
    assert stats["received"] == 48 + len(twice)


def test_an_engine_that_cannot_start_names_the_shard_the_worker_and_the_reason(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_ENV", raising=False)
    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        recipe, ident, cfg = _setup(tmp_path, srv, api_key_env="NO_SUCH_KEY_ENV")
        with pytest.raises(ShardFailed) as err:
            _on_ray(_prompts(6), recipe, ident, cfg, _execution(replicas=1))
        assert srv.stats.received == 0
    msg = str(err.value)
    assert err.value.shard in msg and "node " in msg and "actor " in msg and "pid " in msg
    assert "NO_SUCH_KEY_ENV" in msg and "not set" in msg


def test_the_rate_limits_are_one_set_of_buckets_for_every_worker(ray_cluster, tmp_path):
    with ServerThread(ServerConfig(latency_s=0.05)) as srv:
        recipe, ident, cfg = _setup(tmp_path, srv, requests_per_minute=60_000)
        # both workers up first (a warm-up job of one-prompt shards, no limits): a worker that is still starting
        # when the other has answered every shard would leave one worker asking, and prove nothing
        pool = ShardPool(replicas=2, num_cpus=0.5, max_shard_retries=2, start_timeout_s=120, log=print)
        served: list = []
        real = ray_cluster.kill
        try:
            warm = [{"id": "w0", "prompt": "encode zz ="}, {"id": "w1", "prompt": "encode yy ="}]
            _on_ray(warm, recipe, ident, cfg, _execution(shard_prompts=1), pool=pool)
            wait_for(
                lambda: (
                    len(pool.workers) == 2 and all(ray_cluster.get(w.ready.remote(), timeout=60) for w in pool.workers)
                ),
                120,
                "both workers ready",
            )

            def keep_count(actor, *a, **kw):  # read the job's bucket actor before the stage stops it
                try:
                    served.append(ray_cluster.get(actor.stats.remote(), timeout=10))
                except Exception:  # noqa: BLE001 - a worker, not the limiter
                    pass
                return real(actor, *a, **kw)

            ray_cluster.kill = keep_count
            res, run = _on_ray(_prompts(30), recipe, ident, cfg, _execution(), rate_limits=(60_000, None), pool=pool)
        finally:
            ray_cluster.kill = real
            pool.close()
    assert len({s.worker for s in run.shards}) == 2  # two workers asked
    assert [x["reserved"] for x in served if "reserved" in x] == [{"rpm": 30.0}]  # every request from one bucket


class _StopAfter:
    """A budget guard that stops the job once the answers charged from every worker reach ``limit`` (the number of
    charges until it stopped the job: ``calls_at_stop``)."""

    def __init__(self, limit: int):
        self.limit, self.items, self.calls, self.calls_at_stop = limit, 0, 0, None

    def check_planned(self, share: float) -> None:
        pass

    def charge(self, *, items=1, prompt_tokens=0, completion_tokens=0, seconds=0.0, final=False) -> None:
        from campaign_orchestrator.costs.budget import BudgetExceeded

        self.items += items
        self.calls += 1
        if self.items >= self.limit and not final:
            self.calls_at_stop = self.calls
            raise BudgetExceeded("budget: stopped", scope="campaign t", budget_usd=1.0, spent_usd=1.0, needed_usd=0.1)


def _sealed_answers(cfg: CacheConfig) -> int:
    """Distinct answers in the cache after sealing the spools of writers that are gone (a live one's is skipped)."""
    cfg.recover()
    return len(cfg.open())


def test_the_budget_sees_every_worker_and_stops_the_whole_job(ray_cluster, tmp_path):
    """What is guaranteed, whatever the host's load (a loaded host stretches the time between progress polls, so how
    many answers arrive between the last poll and the stop is not): the guard is charged from every worker and stops
    at the first charge that reaches its limit; every worker is stopped and asks nothing more; what they finished
    is sealed into the cache; a re-run asks again only what was sent and never handed to a spool, which is at most
    CONCURRENCY requests per stopped worker (each of a worker's CONCURRENCY client tasks hands its answer to the spool
    before it sends its next request), plus as many per worker lost in the re-run."""
    from campaign_orchestrator.costs.budget import BudgetExceeded

    with ServerThread(ServerConfig(latency_s=0.1)) as srv:
        recipe, ident, cfg = _setup(tmp_path, srv)
        guard = _StopAfter(10)
        pool = ShardPool(replicas=2, num_cpus=0.5, max_shard_retries=2, poll_s=0.1, log=print)
        with pytest.raises(BudgetExceeded):
            _on_ray(_prompts(48), recipe, ident, cfg, _execution(), budget=guard, pool=pool)
        assert pool.workers == []  # every worker stopped, not only the one whose answer crossed the limit
        assert guard.items >= guard.limit and guard.calls == guard.calls_at_stop  # nothing charged after the stop
        stopped = [w["pid"] for w in pool.where.values()]
        assert len(stopped) == 2
        # their processes gone (the stop waits for that; on a loaded host Ray may report an actor dead before its
        # process exits), every spool is free: sealed into the cache now, they hold at least what the budget counted
        wait_for(lambda: not any(_alive(p) for p in stopped), 120, "the stopped workers' processes gone")
        assert _sealed_answers(cfg) >= guard.items
        # raising the budget and running again resumes: what finished before the stop is not asked again
        res, rerun = _on_ray(_prompts(48), recipe, ident, cfg, _execution())
        asked = srv.stats.as_dict()["received_by_prompt"]
    assert len(res.rows) == 48 and not any(r["error"] for r in res.rows) and res.stats.cache_hits >= guard.items
    again = sum(asked.values()) - 48
    assert len(asked) == 48 and again <= CONCURRENCY * (len(stopped) + len(rerun.lost_workers)), (again, asked)


def _alive(pid: int) -> bool:
    from campaign_orchestrator.generation.scaleout.pool import _alive as alive

    return alive(pid)


def test_the_rayjob_entry_point_runs_a_job_file_on_the_cluster(ray_cluster, tmp_path):
    """``python -m campaign_orchestrator.generation.scaleout --job JOB.json`` (a KubeRay RayJob's command), connected to
    the
    module's cluster: rows in the output Parquet, a JSON summary, the cache filled; a bad job file exits 2."""
    import json
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from campaign_orchestrator.generation.scaleout.job import Job

    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        recipe, ident, cfg = _setup(tmp_path, srv)
        pq.write_table(pa.Table.from_pylist(_prompts(20)), tmp_path / "prompts.parquet")
        job = Job(
            "teacher_generations",
            recipe,
            ident,
            str(tmp_path / "prompts.parquet"),
            str(tmp_path / "out.parquet"),
            vars(cfg),
            S.as_dict(),
            vars(_execution(shard_prompts=8)),
        )
        (tmp_path / "job.json").write_text(job.to_json())
        address = ray_cluster.get_runtime_context().gcs_address
        cmd = [
            sys.executable,
            "-m",
            "campaign_orchestrator.generation.scaleout",
            "--job",
            str(tmp_path / "job.json"),
            "--address",
            address,
            "--summary",
            str(tmp_path / "summary.json"),
        ]
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": os.getcwd()}
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert srv.stats.received == 20
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (summary["rows"], summary["generated"], summary["shards_total"], summary["shards_done"]) == (20, 20, 3, 3)
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["id"] for r in rows] == [str(i) for i in range(20)] and all(r["completion"] for r in rows)
    assert json.loads((tmp_path / "summary.json").read_text())["ray"]["shards_total"] == 3
    (tmp_path / "bad.json").write_text("{}")
    bad = subprocess.run([*cmd[:4], str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "missing field" in bad.stderr


def test_the_ray_executor_gives_the_local_executor_s_rows_and_bill(ray_cluster, tmp_path):
    """``run_generation`` with the Ray executor on the module's cluster (two workers) and with the local executor:
    the same rows, cache keys, budget charges and billed tokens
    (``tests/campaign_orchestrator/generation/test_runner_executors.py``)."""
    from campaign_orchestrator.costs.catalog import token_lines
    from tests.campaign_orchestrator.generation.test_runner_executors import API, assert_same, run_both

    pool = ShardPool(replicas=2, num_cpus=0.5, max_shard_retries=2, log=print)
    price = lambda u: token_lines("teacher", API, u["prompt_tokens"], u["completion_tokens"])  # noqa: E731
    try:
        with ServerThread(ServerConfig(latency_s=0.0, context_length=64)) as srv:
            out = run_both(
                srv,
                tmp_path,
                lambda recipe, ident, cfg: RayExecutor(
                    recipe, ident, cfg, _execution(shard_prompts=8), price=price, pool=pool
                ),
            )
    finally:
        pool.close()
    assert_same(out)
    run = out["ray"]["executor"].run  # every shard the cache lacked ran once on a Ray worker
    assert all(s.attempts == 1 and "actor" in s.worker for s in run.shards if s.cached < s.requests)
