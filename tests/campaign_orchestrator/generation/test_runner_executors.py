"""One runner, two executors: the same requests through ``run_generation`` with the local executor (a backend in
this process) and with the Ray executor give the same rows, the same cache keys, the same usage charged to the
budget guard and the same billed tokens (the project's test server, a real OpenAI backend, real caches).

Here the Ray executor's shards run on an in-process stand-in for the actor pool (one real
:class:`GenerationWorker`, as the pool's actors hold, driven through the pool's callbacks): the executor's driver
side (shards, per-shard billing, rows read back from the cache) without a cluster. The same comparison on a real
local Ray cluster: ``test_the_ray_executor_gives_the_local_executor_s_rows_and_bill`` in
tests/campaign_orchestrator/generation/scaleout/test_ray_stage.py (slow).
"""

from __future__ import annotations

import os
from collections import Counter
from types import SimpleNamespace

import pytest

from campaign_orchestrator.costs.catalog import PriceEntry, token_lines
from campaign_orchestrator.generation.factories import BackendFactory
from campaign_orchestrator.generation.requests import Sampling, namespace
from campaign_orchestrator.generation.runner import LocalExecutor, run_generation
from campaign_orchestrator.generation.scaleout.stage import RayExecutor, shard_cost_lines
from campaign_orchestrator.generation.scaleout.worker import CacheConfig, GenerationWorker
from campaigns.spec import TeacherSpec
from tests.support.testserver import ServerConfig, ServerThread

S = Sampling(max_new_tokens=8)
API = PriceEntry(key="api", unit="million-tokens", input_usd=1.0, output_usd=2.0, as_of="2026-01-01")
# what a row is, whoever answered it (latency and retries are the run's, not the answer's)
SAME = (
    "id",
    "sample_index",
    "prompt",
    "completion",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "backend",
    "model",
    "sampling_hash",
    "request_key",
    "from_cache",
    "error",
    "completion_token_ids",
    "top_logprobs",
)


def prompts() -> list[dict]:
    """30 prompts: 4 asked twice (one cache key, two rows), one longer than the server's context (an error row)."""
    ps = [{"id": str(i), "prompt": f"encode w{chr(97 + i % 26)}{chr(97 + i // 26)} ="} for i in range(25)]
    ps += [{"id": f"again{i}", "prompt": ps[i]["prompt"]} for i in range(4)]
    return ps + [{"id": "long", "prompt": "encode " + "word " * 100 + "="}]


class Recorder:
    """A budget guard that records what it is asked: the planned share and every charge."""

    def __init__(self):
        self.planned: list[float] = []
        self.charged = Counter()

    def check_planned(self, share: float = 1.0) -> None:
        self.planned.append(round(share, 9))

    def charge(
        self,
        *,
        items: int = 1,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        seconds: float = 0.0,
        final: bool = False,
    ) -> None:
        self.charged.update(
            items=items, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, final=int(final)
        )


class InProcessPool:
    """``ShardPool.run``'s contract with one :class:`GenerationWorker` in this process: each shard run to the end,
    its usage to ``on_usage``, its summary (with the worker) to ``on_shard``; the failed rows returned."""

    lost_workers: list = []
    retried: list = []

    def __init__(self):
        self.worker = GenerationWorker(threads=1)
        self.shards_run = 0

    def run(self, recipe, cache, shards, sampling, *, limits=None, on_usage=None, on_shard=None, before_retry=None):
        failed: dict = {}
        for s in shards:
            summary = self.worker.run_shard(recipe, cache, s.id, 1, s.requests, sampling, limits)
            self.shards_run += 1
            if on_usage is not None:
                on_usage(
                    {k: summary[k] for k in ("generated", "failed", "prompt_tokens", "completion_tokens", "seconds")}
                )
            failed.update(summary.pop("failed_rows", {}) or {})
            where = {"pid": os.getpid(), "host": os.uname().nodename, "spool": self.worker.spool}  # no Ray here
            on_shard(summary | {"worker": where, "requests": len(s)})
        return failed


def setup(srv, root) -> tuple:
    """The teacher's recipe and identity, and the cache config under ``root`` (the first 10 prompts cached)."""
    recipe = BackendFactory(
        TeacherSpec(backend="openai", model="teacher", base_url=srv.base_url, price="unpriced", max_concurrency=2)
    )
    ident = recipe.build().identity
    cfg = CacheConfig(str(root / "store"), namespace(ident, S), str(root / "spool"))
    run_generation(prompts()[:10], LocalExecutor(recipe.build()), S, cfg.open())
    return recipe, ident, cfg


def run_both(srv, tmp_path, ray_executor) -> dict:
    """The same prompts through each executor on its own cache (10 prompts cached in both): rows, stats, what the
    guard was charged, the billed lines per resource, the progress total and the requests the server got."""
    out = {}
    for name in ("local", "ray"):
        recipe, ident, cfg = setup(srv, tmp_path / name)
        ex = LocalExecutor(recipe.build()) if name == "local" else ray_executor(recipe, ident, cfg)
        guard, shown = Recorder(), []
        before = srv.stats.received
        res = run_generation(prompts(), ex, S, cfg.open(), progress=shown.append, budget=guard)
        st = res.stats
        lines = (
            token_lines("teacher", API, st.new_prompt_tokens, st.new_completion_tokens)
            if name == "local"
            else shard_cost_lines(ex.run)
        )
        billed = Counter()
        for x in lines:
            billed[x["price_key"]] += x["quantity"]
        out[name] = {
            "rows": [{k: r[k] for k in SAME} for r in res.rows],
            "guard": guard,
            "progress": sum(shown),
            "billed": {k: round(v * 1e6) for k, v in billed.items()},
            "asked": srv.stats.received - before,
            "stats": {
                k: getattr(st, k)
                for k in (
                    "requests",
                    "distinct_requests",
                    "cache_hits",
                    "generated",
                    "failed",
                    "new_prompt_tokens",
                    "new_completion_tokens",
                    "prompt_tokens",
                    "completion_tokens",
                    "finish_reasons",
                )
            },
            "cached_after": len(cfg.open()),
            "executor": ex,
        }
    return out


def assert_same(out: dict) -> None:
    local, ray = out["local"], out["ray"]
    assert len(local["rows"]) == 30 and local["stats"]["cache_hits"] == 10 and local["stats"]["failed"] == 1
    assert local["stats"]["generated"] == 15 and local["asked"] == 16  # 15 answers and the refused long prompt
    assert ray["rows"] == local["rows"]  # same rows, same keys, same cache hits, same error row
    assert ray["stats"] == local["stats"]
    assert ray["asked"] == local["asked"] and ray["cached_after"] == local["cached_after"] == 25
    assert ray["guard"].planned == local["guard"].planned == [pytest.approx(16 / 26)]
    assert ray["guard"].charged == local["guard"].charged  # items, tokens, and one final charge each
    assert local["guard"].charged["items"] == 16 and local["guard"].charged["final"] == 1
    assert (
        ray["billed"]
        == local["billed"]
        == {"api:input": local["stats"]["new_prompt_tokens"], "api:output": local["stats"]["new_completion_tokens"]}
    )
    assert ray["progress"] == local["progress"] == 30


def test_the_local_and_the_ray_executor_give_equal_rows_and_equal_billed_usage(tmp_path):
    pool = InProcessPool()
    execution = SimpleNamespace(
        replicas=1,
        num_cpus_per_replica=1.0,
        num_gpus_per_replica=0.0,
        shard_prompts=8,
        max_shard_retries=0,
        ray_address=None,
    )
    price = lambda u: token_lines("teacher", API, u["prompt_tokens"], u["completion_tokens"])  # noqa: E731
    with ServerThread(ServerConfig(latency_s=0.0, context_length=64)) as srv:
        out = run_both(
            srv, tmp_path, lambda recipe, ident, cfg: RayExecutor(recipe, ident, cfg, execution, price=price, pool=pool)
        )
    assert_same(out)
    run = out["ray"]["executor"].run  # 4 shards of the 26 distinct requests; only those the cache lacks are run
    assert len(run.shards) == 4 and pool.shards_run == sum(1 for s in run.shards if s.cached < s.requests) >= 1


def test_a_shard_s_summary_reports_its_progress_clock_so_the_final_charge_is_made_once(tmp_path):
    """The Ray driver charges the budget from each running shard's progress as it polls, then from the finished
    shard's summary (the difference). A shard whose answers were all polled must add nothing then: its summary's
    usage is what its progress showed at its last answer. (Its seconds were the backend's clock, which runs on past
    the last answer: a seconds-only charge came after the final one, and the guard saw two final charges.)"""
    from dataclasses import dataclass

    worker = GenerationWorker(threads=1)
    snapshots: list[dict] = []

    @dataclass(frozen=True)
    class Watched:  # the worker's own progress, read right after each answer was handed on (a poll that saw it)
        inner: object

        def build(self):
            backend = self.inner.build()
            run = backend.run

            def watched(requests, sampling, on_done):
                run(requests, sampling, lambda r, c: (on_done(r, c), snapshots.append(worker.progress())))

            backend.run = watched
            return backend

    with ServerThread(ServerConfig(latency_s=0.02)) as srv:
        recipe, _ident, cfg = setup(srv, tmp_path)
        from campaign_orchestrator.generation.requests import build_requests

        reqs = [
            r for rs in build_requests(recipe.build().identity, S, [p["prompt"] for p in prompts()[10:20]]) for r in rs
        ]
        summary = worker.run_shard(Watched(recipe), cfg, "s1", 1, reqs, S)
    last = snapshots[-1]
    assert summary["generated"] == last["generated"] == 10
    remainder = {
        k: summary[k] - last[k] for k in ("generated", "failed", "prompt_tokens", "completion_tokens", "seconds")
    }
    assert not any(remainder.values()), remainder  # nothing to charge after the last answer's
