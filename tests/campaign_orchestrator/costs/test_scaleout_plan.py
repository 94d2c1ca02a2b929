"""The teacher stage on N Ray replicas (`campaign plan --replicas`): time, dollars, the endpoint's rate-limit ceiling
and the knee past which more replicas stop helping. Pure arithmetic on the catalog; no model is loaded."""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest
import yaml

from campaign_app.cli.campaigns import scaleout_plan
from campaign_orchestrator.costs.catalog import catalog_for
from campaign_orchestrator.costs.memory import ModelShape, PlanError
from campaign_orchestrator.costs.plan.facts import DataFacts
from campaign_orchestrator.costs.plan.render import render_scaleout
from campaign_orchestrator.costs.plan.roofline import generation_seconds
from campaign_orchestrator.costs.plan.scaleout import (
    ScaleAssumptions,
    cluster_start_for,
    plan_scaleout,
    scale_endpoint,
    scale_self_hosted,
)
from campaigns.loader import load_campaign_file, parse_campaign_text
from tests.support import REPO_ROOT

CATALOG = REPO_ROOT / "campaigns/pricing/catalog.yaml"
# Llama-3.1-8B's shape (config.json figures): a teacher that fits one H100
LLAMA_8B = ModelShape(
    hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256, tied=False
)
FACTS = DataFacts(
    train_prompts=10_000, prompt_tokens_teacher=200.0, shared_prefix_tokens=0.0, tokenizer="model tokenizer"
)


@pytest.fixture(scope="module")
def gpu_spec():
    return load_campaign_file(REPO_ROOT / "campaigns/examples/cluster_ray.yaml")


@pytest.fixture(scope="module")
def endpoint_spec():
    raw = yaml.safe_load((REPO_ROOT / "campaigns/examples/cluster.yaml").read_text())
    raw["teacher"].update(
        requests_per_minute=600, tokens_per_minute=60_000, max_concurrency=2, sampling={"max_new_tokens": 100}
    )
    raw["execution"] = {"executor": "ray", "replicas": 4, "shard_prompts": 100}
    return parse_campaign_text(yaml.safe_dump(raw), "cluster.yaml")


DEFAULT_ASSUME = ScaleAssumptions(cluster_start_s=60.0)


def _self_hosted(spec, replicas, assume=DEFAULT_ASSUME, requests=10_000, devices=1):
    entry = catalog_for(spec, CATALOG).get("h100-sxm")
    return scale_self_hosted(
        requests=requests,
        prompt_tokens=200,
        new_tokens=128,
        decode_tokens=256,
        shard_prompts=256,
        batch_size=256,
        params=LLAMA_8B.active_params,
        weight_bytes=LLAMA_8B.params * 2,
        entry=entry,
        mfu=0.5,
        dtype="bfloat16",
        devices_per_replica=devices,
        tier="on_demand",
        replicas=replicas,
        assume=assume,
    )


def test_self_hosted_time_is_startup_plus_rounds_of_shards_and_every_replica_is_billed(gpu_spec):
    s = _self_hosted(gpu_spec, [1, 2, 4, 8, 16, 32, 40, 64])
    entry = catalog_for(gpu_spec, CATALOG).get("h100-sxm")
    shard = (
        generation_seconds(LLAMA_8B.active_params, LLAMA_8B.params * 2, 256, 200, 128, 256, entry, 0.5, "bfloat16", 256)
        - entry.perf["generate_startup_s"]
        + 0.5
    )
    assert s.shards == 40 and s.shard_seconds == pytest.approx(shard)
    rows = {r.replicas: r for r in s.rows}
    for n, r in rows.items():
        assert r.seconds == pytest.approx(60 + entry.perf["generate_startup_s"] + math.ceil(40 / n) * shard)
        assert r.usd == pytest.approx(n * r.seconds / 3600 * entry.usd)  # each replica, the whole stage
    assert rows[1].speedup == 1.0 and 1.5 < rows[8].speedup < 8  # the start-up does not shrink: sub-linear
    assert [r.seconds for r in s.rows] == sorted((r.seconds for r in s.rows), reverse=True)
    assert rows[64].seconds == rows[40].seconds and rows[64].usd > rows[40].usd  # no shard left
    assert rows[64].bound.startswith("shards") and rows[32].bound == "replicas"
    assert s.max_useful_replicas == 40 and s.price_as_of == "2026-01-15" and s.price_source
    # a tensor-parallel replica of 4 devices: each computes and reads a quarter of the model, and all 4 are billed
    tp = _self_hosted(gpu_spec, [2])
    tp4 = _self_hosted(gpu_spec, [2], devices=4)
    assert tp4.shard_seconds < tp.shard_seconds / 2
    assert tp4.rows[0].usd == pytest.approx(2 * 4 * tp4.rows[0].seconds / 3600 * entry.usd)


def test_cpu_replicas_on_one_host_share_it_and_it_is_billed_once(gpu_spec):
    """A local cluster's CPU replicas: each gets 1/slots of the host's peak, at most `slots` run at once."""
    one_each = _self_hosted(gpu_spec, [1, 2, 4], ScaleAssumptions(cluster_start_s=0.0, shard_overhead_s=0.0))
    shared = scale_self_hosted(
        **(
            dict(
                requests=10_000,
                prompt_tokens=200,
                new_tokens=128,
                decode_tokens=256,
                shard_prompts=256,
                batch_size=256,
                params=LLAMA_8B.active_params,
                weight_bytes=LLAMA_8B.params * 2,
                entry=catalog_for(gpu_spec, CATALOG).get("h100-sxm"),
                mfu=0.5,
                dtype="bfloat16",
                devices_per_replica=1,
                tier="on_demand",
                replicas=[1, 2, 4],
                assume=ScaleAssumptions(cluster_start_s=0.0, shard_overhead_s=0.0),
            )
        ),
        one_host_slots=2,
    )
    assert shared.shard_seconds == pytest.approx(2 * one_each.shard_seconds)  # half the host each
    rows = {r.replicas: r for r in shared.rows}
    assert rows[4].seconds == rows[2].seconds and rows[4].bound == "this host (2 replica(s) at once)"
    h100 = catalog_for(gpu_spec, CATALOG).get("h100-sxm")
    assert rows[2].usd == pytest.approx(rows[2].seconds / 3600 * h100.usd)  # one host billed, not two
    assert shared.max_useful_replicas == 2 and shared.knee_replicas <= 2


def test_knee_is_where_a_doubling_stops_cutting_the_time_by_ten_percent(gpu_spec):
    s = _self_hosted(gpu_spec, [1])
    fixed = 60 + s.model_load_seconds

    def wall(n):
        return fixed + math.ceil(40 / n) * s.shard_seconds

    k = s.knee_replicas
    assert 1 < k < 40 and wall(2 * k) > 0.9 * wall(k)
    assert all(wall(min(2 * n, 40)) <= 0.9 * wall(n) for n in range(1, k))  # before the knee, doubling pays
    # a longer start-up moves the knee down; no start-up moves it out to the shard count
    assert _self_hosted(gpu_spec, [1], ScaleAssumptions(cluster_start_s=600.0)).knee_replicas < k
    assert (
        _self_hosted(
            gpu_spec, [1], ScaleAssumptions(cluster_start_s=0.0, shard_overhead_s=0.0), requests=1_000_000
        ).knee_replicas
        > 64
    )


def test_endpoint_ceiling_from_the_rate_limits_and_the_knee_where_it_binds(endpoint_spec):
    s = plan_scaleout(endpoint_spec, catalog_for(endpoint_spec, CATALOG), FACTS, None, [1, 2, 4, 8, 16])
    assert s.kind == "endpoint" and s.requests == 10_000 and s.shards == 100
    latency = 0.5 + 100 / 50  # first token + completion_fill (1.0) x 100 tokens at 50 tokens/s
    assert s.request_latency_s == pytest.approx(latency)
    per_replica = 2 / latency  # 2 in flight per worker: 0.8 requests/s
    # 600 requests/min = 10/s; 60,000 tokens/min over (200 + 100) tokens = 3.33/s: the token limit binds
    cl = s.ceiling
    assert cl["binding"] == "tokens_per_minute" and cl["requests_per_s"] == pytest.approx(60_000 / 60 / 300)
    assert cl["replicas_to_reach_it"] == math.ceil(cl["requests_per_s"] / per_replica) == 5
    rows = {r.replicas: r for r in s.rows}
    assert rows[1].requests_per_s == pytest.approx(per_replica) and rows[1].bound == "replicas"
    assert rows[4].requests_per_s == pytest.approx(4 * per_replica) and rows[4].bound == "replicas"
    assert rows[8].requests_per_s == pytest.approx(cl["requests_per_s"]) and rows[8].bound == "rate limit"
    assert rows[16].seconds > 10_000 / cl["requests_per_s"]  # never faster than the ceiling allows
    # a local cluster's 5 s start-up, the requests at the ceiling, each replica's shards' overhead
    assert rows[16].seconds == pytest.approx(5.0 + 10_000 / cl["requests_per_s"] + math.ceil(100 / 16) * 0.5)
    # 4 -> 8 replicas goes from 3.2 to the ceiling's 3.33 requests/s: less than 10% faster
    assert s.knee_replicas == 4 and "teacher.tokens_per_minute" in s.why_more_stop_helping
    in_usd, out_usd = catalog_for(endpoint_spec, CATALOG).get("api-open-70b").token_usd()
    assert [r.usd for r in s.rows] == pytest.approx([10_000 * (200 * in_usd + 100 * out_usd) / 1e6] * 5)


def test_endpoint_without_limits_scales_to_the_shard_count():
    s = scale_endpoint(
        requests=1000,
        prompt_tokens=100,
        new_tokens=50,
        max_new_tokens=50,
        shard_prompts=100,
        max_concurrency=4,
        requests_per_minute=None,
        tokens_per_minute=None,
        usd=1.0,
        replicas=[1, 10, 20],
        assume=ScaleAssumptions(cluster_start_s=0.0, shard_overhead_s=0.0),
    )
    assert s.ceiling is None and s.max_useful_replicas == 10
    rows = {r.replicas: r for r in s.rows}
    assert rows[10].speedup == pytest.approx(10) and rows[20].bound.startswith("shards")


def test_self_hosted_plan_from_the_campaign(gpu_spec):
    s = plan_scaleout(gpu_spec, catalog_for(gpu_spec, CATALOG), FACTS, LLAMA_8B)
    assert [r.replicas for r in s.rows] == [1, 2, 4, 8, 16, 32, 64]  # execution.replicas (8) is in the grid
    assert s.assumptions["cluster_start_s"] == 60.0  # a KubeRay cluster comes up first
    assert s.devices_per_replica == 1 and s.configured_replicas == 8 and s.price_key == "h100-sxm"
    text = "\n".join(render_scaleout(s))
    assert "teacher_generations on Ray replicas (self-hosted; 10,000 requests in 40 shard(s) of 256" in text
    assert f"knee: {s.knee_replicas} replica(s)" in text and "price h100-sxm as of 2026-01-15" in text


def test_cluster_start_follows_where_ray_runs(gpu_spec):
    def with_execution(**ex):
        raw = gpu_spec.model_dump(mode="json", exclude_none=True)
        raw["execution"] = {"executor": "ray", **ex}
        return parse_campaign_text(yaml.safe_dump(raw), "c.yaml")

    assert cluster_start_for(gpu_spec) == 60.0
    assert cluster_start_for(with_execution()) == 5.0
    assert cluster_start_for(with_execution(ray_address="ray://head:10001")) == 0.0
    assert cluster_start_for(with_execution(kuberay={"ray_cluster": "shared-ray"})) == 0.0


def test_cli_options_and_their_errors(gpu_spec):
    class Pricing:
        def catalog_for(self, spec):
            return catalog_for(spec, CATALOG)

    plan = SimpleNamespace(data=FACTS, teacher=LLAMA_8B)
    s = scaleout_plan(gpu_spec, Pricing(), plan, "1,3", ["cluster_start_s=0", "knee_gain=0.2"])
    assert [r.replicas for r in s.rows] == [1, 3] and s.assumptions["knee_gain"] == 0.2
    with pytest.raises(PlanError, match="known: cluster_start_s, shard_overhead_s"):
        scaleout_plan(gpu_spec, Pricing(), plan, None, ["start=1"])
    with pytest.raises(PlanError, match="--replicas takes counts"):
        scaleout_plan(gpu_spec, Pricing(), plan, "1,two", None)
    with pytest.raises(PlanError, match="at least 1"):
        scaleout_plan(gpu_spec, Pricing(), plan, "0,2", None)
    from campaign_app.cli.campaigns import add_parsers

    ap = argparse.ArgumentParser()
    add_parsers(ap.add_subparsers())
    args = ap.parse_args(["plan", "demo", "--replicas", "1,2", "--assume", "cluster_start_s=5"])
    assert args.replicas == "1,2" and args.assume == ["cluster_start_s=5"]
