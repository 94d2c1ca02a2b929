"""The teacher's budget counts money, not progress: with 60 of 100 requests in the cache, only the 40 new
generations' reported tokens reach the budget guard and the ledger (the real runner, cache, OpenAI backend and
test HTTP server; the real BudgetGuard and DuckDB ledger, priced by the shipped catalog's api-open-70b)."""

from __future__ import annotations

import pytest

from campaign_orchestrator.costs.budget import BudgetExceeded, BudgetGuard, Limit
from campaign_orchestrator.costs.catalog import read_catalog, token_lines, total
from campaign_orchestrator.costs.ledger import Ledger
from campaign_orchestrator.demo import cipher
from campaign_orchestrator.generation.backends import OpenAIBackend
from campaign_orchestrator.generation.blobstore import LocalStore
from campaign_orchestrator.generation.cache import GenerationCache
from campaign_orchestrator.generation.openai_client import OpenAICompatibleClient
from campaign_orchestrator.generation.requests import Sampling, namespace
from campaign_orchestrator.generation.runner import run_generation
from campaigns import paths
from tests.support.testserver import ServerConfig, ServerThread


def _words(n: int) -> list[str]:
    import random

    rng, out = random.Random(0), []
    while len(out) < n:
        w = cipher.random_word(rng)
        if w not in out:
            out.append(w)
    return out


PROMPTS = [{"id": f"p{i}", "prompt": cipher.prompt_for(w)} for i, w in enumerate(_words(100))]
CACHED = PROMPTS[:60]
ENTRY = read_catalog(paths.shipped_campaigns_dir() / "pricing" / "catalog.yaml").get("api-open-70b")
SAMPLING = Sampling(max_new_tokens=16)


def _backend(srv, concurrency: int = 2) -> OpenAIBackend:
    return OpenAIBackend(OpenAICompatibleClient(srv.base_url, "teacher", max_concurrency=concurrency))


def _cache(root, backend) -> GenerationCache:
    return GenerationCache(LocalStore(root / "cache"), namespace(backend.identity, SAMPLING), root / "spool")


def _guard(ledger: Ledger, budget_usd: float, planned_usd: float | None = None) -> BudgetGuard:
    g = BudgetGuard(
        ledger=ledger,
        campaign="c",
        stage="teacher_generations",
        run_id="r",
        step_key="s",
        attempt=0,
        stage_key="k",
        limits=[Limit("campaign c", budget_usd, 0.0)],
        log=lambda m: None,
        metered=lambda u: token_lines("teacher", ENTRY, u.prompt_tokens, u.completion_tokens),
    )
    g.planned_usd = planned_usd
    return g


def _usd(stats) -> float:
    return total(token_lines("teacher", ENTRY, stats.new_prompt_tokens, stats.new_completion_tokens))


def test_cache_hits_cost_nothing_and_the_guard_stops_within_one_answer(tmp_path):
    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        # what the 40 uncached requests and the 60 cached ones cost, measured on a throwaway cache
        ref = run_generation(PROMPTS, _backend(srv), SAMPLING, _cache(tmp_path / "ref", _backend(srv)))
        rest_usd = _usd(
            run_generation(PROMPTS[60:], _backend(srv), SAMPLING, _cache(tmp_path / "ref2", _backend(srv))).stats
        )
        all_usd = _usd(ref.stats)
        assert 0 < rest_usd < 0.5 * all_usd  # the cached 60 alone would pass a budget sized for the 40
        run_generation(CACHED, _backend(srv), SAMPLING, _cache(tmp_path / "a", _backend(srv)))
        run_generation(CACHED, _backend(srv), SAMPLING, _cache(tmp_path / "b", _backend(srv)))

        # 1. the budget covers the 40: they all run (the planner's $ for all 100 is checked for the 40% left)
        ledger = Ledger(tmp_path / "ledger.duckdb")
        guard = _guard(ledger, rest_usd * 1.05, planned_usd=all_usd)
        srv.stats.received = 0
        logs: list[str] = []
        shown: list[int] = []
        res = run_generation(
            PROMPTS,
            _backend(srv),
            SAMPLING,
            _cache(tmp_path / "a", _backend(srv)),
            progress=shown.append,
            budget=guard,
            log=logs.append,
        )
        assert srv.stats.received == 40 and res.stats.cache_hits == 60 and res.stats.generated == 40
        assert guard.usage.items == 40 and guard.accrued_usd() == pytest.approx(rest_usd) == _usd(res.stats)
        assert not guard.stopped and ledger.spent("c") == 0.0
        assert shown[0] == 60 and sum(shown) == 100  # progress shows the hits; the guard never saw them
        assert any("60 cache hits ($0), 40 to generate" in m for m in logs)

        # 2. the budget covers half of the 40: it stops within one answer; the ledger holds only what was paid
        guard = _guard(ledger, rest_usd * 0.5)
        srv.stats.received = 0
        with pytest.raises(BudgetExceeded, match="stopped teacher_generations mid-way") as e:
            run_generation(
                PROMPTS, _backend(srv, concurrency=1), SAMPLING, _cache(tmp_path / "b", _backend(srv)), budget=guard
            )
        paid = guard.usage.items
        spent = ledger.spent("c")
        assert 0 < paid < 40 and srv.stats.received == paid  # one request at a time: nothing sent after the stop
        assert spent == pytest.approx(guard.accrued_usd()) and spent <= rest_usd * 0.5
        assert spent + e.value.needed_usd > rest_usd * 0.5 and 0 < e.value.needed_usd < rest_usd / 40 * 2
        assert ledger.query("SELECT DISTINCT status FROM cost_lines") == [{"status": "interrupted"}]

        # ... and a rerun under a budget for the rest pays only for what neither the cache nor the stop has
        guard = _guard(ledger, rest_usd)
        res = run_generation(PROMPTS, _backend(srv), SAMPLING, _cache(tmp_path / "b", _backend(srv)), budget=guard)
        assert res.stats.cache_hits == 60 + paid and guard.usage.items == 40 - paid
        assert spent + guard.accrued_usd() == pytest.approx(rest_usd)


def test_the_planner_estimate_is_checked_for_the_uncached_share_only(tmp_path):
    """With 60% cached, an estimate for the whole stage that does not fit, but whose 40% does, lets it start;
    an estimate whose 40% does not fit refuses before a single request is sent."""
    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        run_generation(CACHED, _backend(srv), SAMPLING, _cache(tmp_path, _backend(srv)))
        srv.stats.received = 0
        with pytest.raises(BudgetExceeded, match=r"the planner estimates \$0\.400000"):
            run_generation(
                PROMPTS,
                _backend(srv),
                SAMPLING,
                _cache(tmp_path, _backend(srv)),
                budget=_guard(Ledger(tmp_path / "l.duckdb"), 0.39, planned_usd=1.0),
            )
        assert srv.stats.received == 0 and Ledger(tmp_path / "l.duckdb").spent("c") == 0.0
        res = run_generation(
            PROMPTS,
            _backend(srv),
            SAMPLING,
            _cache(tmp_path, _backend(srv)),
            budget=_guard(Ledger(tmp_path / "l.duckdb"), 0.41, planned_usd=1.0),
        )
        assert res.stats.generated == 40 and srv.stats.received == 40
