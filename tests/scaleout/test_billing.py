"""Every paid row billed exactly once on Ray: a worker SIGKILLed mid-shard, against the project's test server (which
counts the tokens of every answer it sends), leaves a ledger whose tokens equal the server's served tokens: what
the killed attempt was answered is billed, and the retried shard does not bill it again."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

import pytest

from campaign_orchestrator.costs.catalog import PriceEntry, token_lines
from campaign_orchestrator.costs.ledger import Ledger
from campaign_orchestrator.generation.recipes import BackendRecipe
from campaign_orchestrator.generation.requests import Sampling, namespace
from campaign_orchestrator.generation.scaleout.pool import ShardPool
from campaign_orchestrator.generation.scaleout.stage import shard_cost_lines
from campaign_orchestrator.generation.scaleout.worker import CacheConfig
from campaigns.spec import TeacherSpec
from tests.support.processes import wait_for
from tests.support.ray_support import on_ray
from tests.support.testserver import ServerConfig, ServerThread

pytestmark = pytest.mark.slow

S = Sampling(max_new_tokens=8)
API = PriceEntry(key="api", unit="million-tokens", input_usd=1.0, output_usd=2.0, as_of="2026-01-01")


def _on_ray(prompts, recipe, ident, cfg, execution, budget=None, **executor):
    return on_ray(prompts, S, recipe, ident, cfg, execution, budget=budget, **executor)


def _prompts(n: int) -> list[dict]:
    return [{"id": str(i), "prompt": f"encode w{chr(97 + i % 26)}{chr(97 + i // 26)} ="} for i in range(n)]


def test_a_worker_killed_mid_shard_is_billed_for_what_it_was_answered_and_the_retry_is_not(ray_cluster, tmp_path):
    hold = threading.Event()
    with ServerThread(ServerConfig(latency_s=0.1, hold=hold)) as srv:
        spec = TeacherSpec(
            backend="openai", model="teacher", base_url=srv.base_url, price="unpriced", max_concurrency=2
        )
        recipe = BackendRecipe(spec)
        ident = recipe.build().identity
        cfg = CacheConfig(str(tmp_path / "store"), namespace(ident, S), str(tmp_path / "spool"))
        ex = SimpleNamespace(
            replicas=2,
            num_cpus_per_replica=0.5,
            num_gpus_per_replica=0.0,
            shard_prompts=12,
            max_shard_retries=2,
            ray_address=None,
        )
        pool = ShardPool(replicas=2, num_cpus=0.5, max_shard_retries=2, log=print)
        price = lambda u: token_lines("teacher", API, u["prompt_tokens"], u["completion_tokens"])  # noqa: E731
        box: dict = {}

        def stage():
            try:
                box["out"] = _on_ray(_prompts(48), recipe, ident, cfg, ex, pool=pool, price=price)
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
                    if p and 4 <= p["generated"] <= p["to_ask"] - 4 and w in pool.where:
                        return w
                return None

            victim = wait_for(busy_worker, 120, "a worker part-way through a shard", every_s=0.02)
            # hold new answers and let those being served reach their clients: every answer the server sends from
            # now on goes to a live worker, and the victim's spool holds every answer it was sent
            hold.set()
            wait_for(lambda: srv.stats.in_flight == srv.stats.held, 30, "answers in service delivered", every_s=0.01)
            # and until the victim has recorded every answer it was sent (its count, bumped after the spool's
            # per-row flush, stops moving): on a loaded host a delivered answer can wait a while to be parsed
            seen: list[int] = []

            def settled() -> bool:
                seen.append(ray_cluster.get(victim.progress.remote(), timeout=5)["generated"])
                return len(seen) >= 4 and len(set(seen[-4:])) == 1

            wait_for(settled, 30, "the victim's recorded answers to settle", every_s=0.25)
            os.kill(pool.where[victim]["pid"], signal.SIGKILL)
            wait_for(lambda: srv.stats.by_status[499] >= 1, 30, "the victim's held requests dropped", every_s=0.02)
            hold.clear()
            th.join(180)
        finally:
            hold.clear()
            th.join(180)
            pool.close()
        assert "error" not in box, box.get("error")
        res, run = box["out"]
        served = srv.stats.as_dict()

    assert len(run.lost_workers) == 1 and len(run.retried) == 1  # the kill happened mid-shard, and was retried
    assert len(res.rows) == 48 and not any(r["error"] for r in res.rows)
    ledger = Ledger(tmp_path / "ledger.duckdb")
    ledger.record_stage(
        campaign="c",
        asset="teacher_generations",
        run_id="r1",
        step_key="s",
        manifest={"production_id": "p1", "key": "k", "cost_lines": shard_cost_lines(run)},
    )
    billed = {
        r["price_key"]: round(r["tokens"])
        for r in ledger.query(
            "SELECT resource AS price_key, SUM(quantity) * 1e6 AS tokens FROM cost_lines GROUP BY resource"
        )
    }
    assert billed == {"api:input": served["served_prompt_tokens"], "api:output": served["served_completion_tokens"]}
    # the stage's own statistics agree: every row generated in this run, once
    assert res.stats.new_prompt_tokens == served["served_prompt_tokens"]
    assert res.stats.new_completion_tokens == served["served_completion_tokens"]
