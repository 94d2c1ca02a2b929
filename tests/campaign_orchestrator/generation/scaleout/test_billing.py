"""Every paid answer billed on Ray: a worker SIGKILLed mid-shard, against the project's test server (which counts the
tokens of every answer it sends and every request it drops), leaves a ledger whose verified tokens equal the tokens
the workers received, with the requests in flight at the kill billed as paid-unverified at their upper bound."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

import pytest

from campaign_orchestrator.costs.catalog import PriceEntry, token_lines
from campaign_orchestrator.costs.ledger import Ledger
from campaign_orchestrator.generation.factories import BackendFactory
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


def test_a_killed_worker_s_answers_are_billed_and_its_requests_in_flight_at_their_upper_bound(ray_cluster, tmp_path):
    """A worker SIGKILLed with a request in flight (held by the server) and an answer it has received but not yet
    recorded (its hand-off to the spool held by a gate): every answer the workers received is billed from its usage
    (verified lines == tokens the server sent, all to live clients: the received one twice, as the retry asks it
    again), the request in flight is recorded as paid-unverified at its upper bound (prompt bytes + overhead,
    max_tokens), and the ledger is never below what was served."""
    from campaign_orchestrator.generation.openai_client import PROMPT_OVERHEAD_TOKENS
    from campaign_orchestrator.generation.scaleout.stage import ray_metadata
    from tests.support.ray_support import GatedRecipe

    hold = threading.Event()
    gates = tmp_path / "gates"
    gates.mkdir()
    with ServerThread(ServerConfig(latency_s=0.1, hold=hold)) as srv:
        spec = TeacherSpec(
            backend="openai", model="teacher", base_url=srv.base_url, price="unpriced", max_concurrency=2
        )
        inner = BackendFactory(spec)
        recipe = GatedRecipe(inner, str(gates))
        ident = inner.build().identity
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

            def busy_worker():  # a worker part-way through a shard: some answers finished, several to go
                for w in list(pool.workers):
                    try:
                        p = ray_cluster.get(w.progress.remote(), timeout=5)
                    except Exception:  # noqa: BLE001 - starting or gone
                        continue
                    if p and 4 <= p["generated"] <= p["to_ask"] - 5 and w in pool.where:
                        return w, p
                return None

            victim, before = wait_for(busy_worker, 120, "a worker part-way through a shard", every_s=0.02)
            shard = _shard_prompts(ident, before["shard"])
            # hold new answers; those being served reach their clients, and the victim records them
            hold.set()
            wait_for(lambda: srv.stats.in_flight == srv.stats.held, 30, "answers in service delivered", every_s=0.01)

            def victim_held() -> list[str]:  # the victim's two requests, both held: it asks nothing else now
                held = [p for p, n in srv.stats.held_by_prompt.items() if n and p in shard]
                return held if len(held) == 2 else []

            held = wait_for(victim_held, 30, "the victim's two requests held", every_s=0.02)
            # one of them answered into a gate: received (and journaled) by the victim, not handed on to its spool
            (gates / str(pool.where[victim]["pid"])).write_text("")
            srv.cfg.release.add(held[0])
            blocked = gates / f"{pool.where[victim]['pid']}.blocked"
            wait_for(blocked.exists, 30, "an answer received by the victim and not yet recorded", every_s=0.01)
            assert blocked.read_text() == held[0] and srv.stats.ok_by_prompt[held[0]] == 1
            os.kill(pool.where[victim]["pid"], signal.SIGKILL)
            wait_for(lambda: srv.stats.dropped_by_prompt[held[1]] >= 1, 30, "the victim's held request dropped")
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
    # the answer received and not recorded was asked again by the retry (and paid again); the dropped one too
    assert served["ok_by_prompt"][held[0]] == 2 and served["dropped_by_prompt"] == {held[1]: 1}
    ledger = Ledger(tmp_path / "ledger.duckdb")
    ledger.record_stage(
        campaign="c",
        asset="teacher_generations",
        run_id="r1",
        step_key="s",
        manifest={"production_id": "p1", "key": "k", "cost_lines": shard_cost_lines(run)},
    )
    billed = {
        (r["price_key"], r["verified"]): round(r["tokens"])
        for r in ledger.query(
            "SELECT resource AS price_key, verified, SUM(quantity) * 1e6 AS tokens FROM cost_lines GROUP BY ALL"
        )
    }
    # every answer the workers received, from its usage: all the server sent, since each reached a live worker
    assert billed[("api:input", True)] == served["served_prompt_tokens"]
    assert billed[("api:output", True)] == served["served_completion_tokens"]
    # the request in flight at the kill: paid-unverified at its upper bound
    assert billed[("api:input", False)] == len(held[1].encode()) + PROMPT_OVERHEAD_TOKENS
    assert billed[("api:output", False)] == S.max_new_tokens
    total = ledger.query("SELECT SUM(usd) AS usd FROM cost_lines")[0]["usd"]
    paid = (served["served_prompt_tokens"] * API.input_usd + served["served_completion_tokens"] * API.output_usd) / 1e6
    assert total >= paid
    md = ray_metadata(run)  # the stage says how much of its bill is unverified
    assert md["unverified_requests"] == 1 and 0 < md["unverified_share"] < 0.2
    assert md["unverified_usd"] == pytest.approx(total - paid)


def _shard_prompts(ident: str, shard_id: str) -> set[str]:
    """The prompts of one shard of the 48 (12 a shard, cut by content as the executor cuts them)."""
    from campaign_orchestrator.generation.requests import build_requests
    from campaign_orchestrator.generation.scaleout.shards import make_shards

    reqs = [r for rs in build_requests(ident, S, [p["prompt"] for p in _prompts(48)]) for r in rs]
    return {r.prompt for s in make_shards(reqs, 12) if s.id == shard_id for r in s.requests}
