"""Scale-out's plain logic, without Ray: shards by content, shared-bucket arithmetic, the job file, and a worker
answering a shard into the cache (its finished rows survive it; a re-run asks only what the cache lacks)."""

from __future__ import annotations

import json
import random

import pytest

from campaign_orchestrator.generation.factories import BackendFactory, LocalModelFactory
from campaign_orchestrator.generation.requests import Sampling, build_requests, namespace
from campaign_orchestrator.generation.scaleout.job import AnswerFactory, Job
from campaign_orchestrator.generation.scaleout.ratelimit import BucketState
from campaign_orchestrator.generation.scaleout.shards import make_shards, shard_id
from campaign_orchestrator.generation.scaleout.worker import CacheConfig, GenerationWorker, _stats_delta
from campaigns.spec import TeacherSpec
from tests.support.testserver import ServerConfig, ServerThread

S = Sampling(max_new_tokens=8)


def _requests(prompts, identity="openai:x|teacher@"):
    return [r for rs in build_requests(identity, S, prompts) for r in rs]


def test_shards_are_formed_by_content_whatever_the_order():
    prompts = [f"encode w{i} =" for i in range(50)]
    a = make_shards(_requests(prompts), 8)
    shuffled = prompts[:]
    random.Random(0).shuffle(shuffled)
    b = make_shards(_requests(shuffled + prompts[:5]), 8)  # another order, and duplicates
    assert [s.id for s in a] == [s.id for s in b]
    assert [len(s) for s in a] == [8] * 6 + [2]
    assert sorted(k for s in a for k in s.keys) == sorted({r.key for r in _requests(prompts)})
    assert a[0].id == shard_id(reversed(a[0].keys))  # the id hashes the set of keys
    # another model (another identity) is other requests, so other shards
    assert {s.id for s in make_shards(_requests(prompts, "openai:y|teacher@"), 8)}.isdisjoint({s.id for s in a})
    with pytest.raises(ValueError):
        make_shards([], 0)


def test_a_shared_bucket_serves_reservations_in_order_at_the_rate():
    now = [0.0]
    b = BucketState(120, clock=lambda: now[0])  # 2 per second, holding 2
    waits = [b.reserve(1) for _ in range(6)]
    assert waits == pytest.approx([0, 0, 0.5, 1.0, 1.5, 2.0])  # whoever asks, the job never exceeds the rate
    now[0] = 10.0
    b.refund(0)
    assert b.reserve(1) == 0


def test_stats_delta_is_one_shards_share():
    before = {"http_requests": 10, "retry_reasons": {"429": 1}, "compute_dtype": "float32"}
    after = {"http_requests": 25, "retry_reasons": {"429": 3, "500": 1}, "compute_dtype": "float32"}
    assert _stats_delta(before, after) == {
        "http_requests": 15,
        "retry_reasons": {"429": 2, "500": 1},
        "compute_dtype": "float32",
    }


def test_job_file_round_trips_and_names_what_is_wrong(tmp_path):
    spec = TeacherSpec(
        backend="openai", model="teacher", base_url="http://127.0.0.1:1/v1", price="unpriced", api_key_env="MY_KEY"
    )
    job = Job(
        "teacher_generations",
        BackendFactory(spec),
        "openai:x",
        "p.parquet",
        "out.parquet",
        {"store_url": "/c", "namespace": "n", "spool_dir": "/s"},
        S.as_dict(),
        {"replicas": 2},
    )
    text = job.to_json()
    assert "MY_KEY" in text and "sk-" not in text  # the variable's name travels, never a key
    back = Job.from_json(text)
    assert back.recipe == job.recipe and back.sampling == job.sampling
    ans = Job("answers", AnswerFactory(LocalModelFactory("/m", "/a"), "local:x"), "local:x", "p", "o", {}, {}, {})
    assert Job.from_json(ans.to_json()).recipe == ans.recipe
    with pytest.raises(ValueError, match="missing field"):
        Job.from_json(json.dumps({"kind": "answers"}))
    with pytest.raises(ValueError, match="kind must be one of"):
        Job.from_json(text.replace('"teacher_generations"', '"nope"'))


def test_a_worker_answers_what_the_cache_lacks_and_its_spool_outlives_it(tmp_path):
    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        spec = TeacherSpec(
            backend="openai", model="teacher", base_url=srv.base_url, price="unpriced", max_concurrency=2
        )
        recipe = BackendFactory(spec)
        ident = recipe.build().identity
        cfg = CacheConfig(str(tmp_path / "store"), namespace(ident, S), str(tmp_path / "spool"))
        reqs = [r for rs in build_requests(ident, S, [f"encode w{chr(97 + i)} =" for i in range(6)]) for r in rs]
        worker = GenerationWorker(threads=1)
        out = worker.run_shard(recipe, cfg, "s1", 1, reqs[:4], S)
        assert (out["generated"], out["cached"], out["done"]) == (4, 0, True)
        assert len(cfg.open().shards()) == 1  # one Parquet file of the cache per shard
        assert (tmp_path / "spool" / "workers" / worker.spool).is_dir()  # its own spool directory
        assert out["backend_stats"]["http_requests"] == 4
        # a shard overlapping a finished one asks only the missing requests
        again = worker.run_shard(recipe, cfg, "s2", 1, reqs, S)
        assert (again["generated"], again["cached"]) == (2, 4)
        assert srv.stats.received == 6 and set(srv.stats.received_by_prompt.values()) == {1}

        # a dead worker's spool (rows written, never sealed, lock free, in its own directory) is sealed by the
        # driver's recovery of that worker, and the retried shard asks only the rest
        more = [r for rs in build_requests(ident, S, ["encode zz =", "encode yy ="]) for r in rs]
        cache = cfg.open(worker="dead-1")
        w = cache.writer()
        from campaign_orchestrator.generation.completion import Completion
        from campaign_orchestrator.generation.runner import _cache_row

        w.add(
            {
                k: v
                for k, v in _cache_row(more[0], Completion(" xx", "stop", 3, 2, 0.0), recipe.build()).items()
                if k != "error"
            }
        )
        w._file.close()  # the process "died": its lock is gone, the spool stays
        assert cfg.recover("dead-1") == 1
        last = worker.run_shard(recipe, cfg, "s3", 1, more, S)
        assert (last["generated"], last["cached"]) == (1, 1)
        assert "encode zz =" not in srv.stats.received_by_prompt and srv.stats.received_by_prompt["encode yy ="] == 1


def test_run_on_ray_refuses_a_kuberay_stage_and_the_stages_launch_it_instead():
    """``run_on_ray`` runs Ray where its process is: a campaign with execution.kuberay is refused there (never run on
    a local cluster instead). The stages' executor choice (stages/executors.py) gives such a stage the KubeRay
    runner, and refuses it too when the stage was given no launcher."""
    from types import SimpleNamespace

    from campaign_orchestrator.generation.scaleout.stage import KubeRayNotLaunched, run_on_ray
    from stages.context import StageContext
    from stages.executors import InProcess, KubeRayJob, RayPool, executor_for

    execution = SimpleNamespace(kuberay=SimpleNamespace(), ray_address=None, executor="ray")
    with pytest.raises(KubeRayNotLaunched, match="launched by its Dagster asset"):
        run_on_ray(execution, [{"id": "0", "prompt": "x"}], None, "id", None, None, log=print)
    kuberay = SimpleNamespace(name="c", execution=execution)
    pool = SimpleNamespace(name="c", execution=SimpleNamespace(kuberay=None, ray_address=None, executor="ray"))
    local = SimpleNamespace(name="c", execution=SimpleNamespace(kuberay=None, ray_address=None, executor="local"))
    assert type(executor_for(local, "answers", StageContext())) is InProcess
    assert type(executor_for(pool, "answers", StageContext())) is RayPool
    assert executor_for(pool, "answers", StageContext()).runner("answers") is run_on_ray
    runner = executor_for(kuberay, "evaluation", StageContext(kuberay=object()), "/x").runner("answers")
    assert runner is not run_on_ray and runner.__name__ == "run"
    with pytest.raises(KubeRayNotLaunched, match="no KubeRay launcher"):
        KubeRayJob(kuberay, None, "evaluation", "/x").runner("answers")


def test_a_job_summary_gives_back_the_stats_and_shard_reports_priced_on_the_dagster_side():
    """What the RayJob's driver writes (``ray_summary.json``: ``stats``, ``ray``) is read back as the stage's
    GenerationStats and RayRun, each shard priced with the stage's price callback (lines tagged with the shard id)."""
    from dataclasses import asdict

    from campaign_orchestrator.generation.runner import GenerationStats
    from campaign_orchestrator.generation.scaleout.__main__ import shard_message
    from campaign_orchestrator.generation.scaleout.stage import (
        RayRun,
        ShardReport,
        price_shard,
        shard_cost_lines,
        stats_from_dict,
    )

    st = GenerationStats(prompts=3, requests=3, generated=2, cache_hits=1, new_completion_tokens=9, generate_s=1.5)
    run = RayRun(
        shards=[
            ShardReport(
                "aa", 0, 2, generated=2, prompt_tokens=10, completion_tokens=9, seconds=1.5, worker="w1", attempts=1
            ),
            ShardReport("bb", 1, 1, cached=1),
        ],
        nodes={"10.0.0.1 abcd": 1},
        wall_s=2.0,
    )
    summary = json.loads(json.dumps({"stats": st.as_dict(), "ray": run.as_dict()}))  # as the file holds it
    back = RayRun.from_dict(summary["ray"])
    assert stats_from_dict(summary["stats"]) == st
    assert [asdict(s) for s in back.shards] == [asdict(s) for s in run.shards] and back.done == 2
    assert shard_message(back.shards[0], back) == {
        "kind": "ray_shard",
        "shard": "aa",
        "generated": 2,
        "failed": 0,
        "prompt_tokens": 10,
        "completion_tokens": 9,
        "seconds": 1.5,
        "shards_done": 2,
        "shards_total": 2,
        "final": True,
    }
    for rep in back.shards:
        price_shard(rep, lambda u: [{"kind": "teacher", "usd": u["completion_tokens"] * 0.01}])
    assert back.shards[0].usd == pytest.approx(0.09) and back.shards[1].lines is None  # cached: $0, no line
    assert shard_cost_lines(back) == [{"kind": "teacher", "usd": pytest.approx(0.09), "shard": "aa"}]
    price_shard(back.shards[0], lambda u: None)  # an unpriced teacher: the stage's cost is unknown, never $0
    assert back.shards[0].usd is None and shard_cost_lines(back) is None
