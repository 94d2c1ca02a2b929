"""The simulated scale table of the teacher stage on Ray replicas (the planner's model, NOT a measurement; prints JSON).

10 k / 1 M / 10 M prompts over 1-64 GPU replicas, for three teachers:

* an 8B-class model (Llama-3.1-8B's shape) self-hosted on one H100 per replica,
* a 70B-class model (Llama-3.1-70B's shape) self-hosted with tensor parallelism 4 (4 H100 per replica),
* an endpoint (the catalog's ``api-open-70b`` price) under a provider quota, 64 requests in flight per Ray worker.

Each row is ``campaign_orchestrator.costs.plan.scaleout.scale_self_hosted`` / ``scale_endpoint``: per-replica throughput
from the pricing catalog's ``perf`` block (roofline: peak FLOP/s x generation MFU against weight reads per decode
step over memory bandwidth, plus the per-decode-step overhead and the model load), prices from the catalog with
their dates and sources, and the stated assumptions (tokens per prompt, shard size, cluster start-up, per-shard
overhead, endpoint latency and quota). Everything it assumes is in the JSON.

Checks (exit status 1 when one fails): the time never grows with replicas; with 10 M prompts (shards >> replicas)
64 self-hosted replicas are at least 32x faster than one (the start-up is amortised); no endpoint row beats the
rate-limit ceiling; and past the knee a doubling never cuts the time by 10% or more.

Usage: python benchmarks/ray_scale_plan.py [--replicas 1,2,4,8,16,32,64] [--prompts 10000,1000000,10000000]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# config.json figures of the two public model shapes (hidden, intermediate, layers, heads, kv heads, vocab)
SHAPES = {
    "llama-3.1-8b": dict(
        hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256, tied=False
    ),
    "llama-3.1-70b": dict(
        hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, head_dim=128, vocab=128256, tied=False
    ),
}
WORKLOAD = {
    "prompt_tokens": 200,
    "max_new_tokens": 256,
    "completion_fill": 0.5,
    "batch_size": 256,
    "shard_prompts": 256,
    "dtype": "bfloat16",
    "generation_mfu": 0.5,
    "pricing_tier": "on_demand",
}
ENDPOINT = {
    "price": "api-open-70b",
    "max_concurrency_per_worker": 64,
    "requests_per_minute": 10_000,
    "tokens_per_minute": 2_000_000,
}
MIN_SPEEDUP_64_AT_10M = 32.0


def tables(replicas: list[int], prompts: list[int]) -> dict:
    from campaign_orchestrator.costs.catalog import read_catalog
    from campaign_orchestrator.costs.memory import ModelShape
    from campaign_orchestrator.costs.plan.scaleout import ScaleAssumptions, scale_endpoint, scale_self_hosted

    catalog_path = REPO / "campaigns/pricing/catalog.yaml"
    catalog = read_catalog(catalog_path)
    h100, api = catalog.get("h100-sxm"), catalog.get(ENDPOINT["price"])
    assume = ScaleAssumptions(cluster_start_s=60.0)  # a KubeRay cluster: pods scheduled, a GPU image pulled
    w = WORKLOAD
    new_tokens = w["max_new_tokens"] * w["completion_fill"]
    out = []
    for name, tp in (("llama-3.1-8b", 1), ("llama-3.1-70b", 4)):
        shape = ModelShape(**SHAPES[name])
        for n in prompts:
            s = scale_self_hosted(
                requests=n,
                prompt_tokens=w["prompt_tokens"],
                new_tokens=new_tokens,
                decode_tokens=w["max_new_tokens"],
                shard_prompts=w["shard_prompts"],
                batch_size=w["batch_size"],
                params=shape.active_params,
                weight_bytes=shape.params * 2,
                entry=h100,
                mfu=w["generation_mfu"],
                dtype=w["dtype"],
                devices_per_replica=tp,
                tier=w["pricing_tier"],
                replicas=replicas,
                assume=assume,
            )
            out.append(_summary(f"{name} self-hosted, {tp} x h100-sxm per replica", n, s))
    in_usd, out_usd = api.token_usd()
    for n in prompts:
        s = scale_endpoint(
            requests=n,
            prompt_tokens=w["prompt_tokens"],
            new_tokens=new_tokens,
            max_new_tokens=w["max_new_tokens"],
            shard_prompts=w["shard_prompts"],
            max_concurrency=ENDPOINT["max_concurrency_per_worker"],
            requests_per_minute=ENDPOINT["requests_per_minute"],
            tokens_per_minute=ENDPOINT["tokens_per_minute"],
            usd=n * (w["prompt_tokens"] * in_usd + new_tokens * out_usd) / 1e6,
            replicas=replicas,
            assume=ScaleAssumptions(cluster_start_s=5.0),  # CPU workers start fast
            first_token_s=api.perf.get("first_token_s"),
            stream_tokens_per_s=api.perf.get("stream_tokens_per_s"),
        )
        out.append(_summary(f"endpoint {ENDPOINT['price']}", n, s))
    prices = [
        {
            "key": e.key,
            "unit": e.unit,
            "usd": e.usd,
            "input_usd": e.input_usd,
            "output_usd": e.output_usd,
            "as_of": e.as_of,
            "source": e.source,
        }
        for e in (h100, api)
    ]
    perf = {"h100-sxm": h100.perf}
    return {
        "what": "simulated with the planner (campaign_orchestrator.costs.plan.scaleout), not measured",
        "catalog": str(catalog_path.relative_to(REPO)),
        "catalog_version": catalog.version,
        "prices": prices,
        "perf": perf,
        "workload": WORKLOAD,
        "model_shapes": SHAPES,
        "endpoint": ENDPOINT,
        "assumptions": {
            "self_hosted": asdict(assume),
            "endpoint": asdict(ScaleAssumptions(cluster_start_s=5.0)),
            "billing": "every replica (its GPUs) billed for the whole stage, idle tail included",
        },
        "tables": out,
    }


def _summary(teacher: str, prompts: int, s) -> dict:
    rows = [
        {
            "replicas": r.replicas,
            "hours": round(r.seconds / 3600, 4),
            "usd": round(r.usd, 2),
            "speedup": round(r.speedup, 2),
            "efficiency": round(r.efficiency, 3),
            "bound": r.bound,
        }
        for r in s.rows
    ]
    keep = (
        "shards",
        "shard_seconds",
        "model_load_seconds",
        "request_latency_s",
        "requests_per_s_per_replica",
        "ceiling",
        "knee_replicas",
        "max_useful_replicas",
        "why_more_stop_helping",
    )
    return {
        "teacher": teacher,
        "prompts": prompts,
        "rows": rows,
        "_seconds": [r.seconds for r in s.rows],
        **{k: getattr(s, k) for k in keep if getattr(s, k) is not None or k == "ceiling"},
    }


def checks(result: dict, replicas: list[int]) -> dict:
    out = {
        "time_never_grows_with_replicas": True,
        "ceiling_respected": True,
        "speedup_64_at_10m": None,
        "knee_is_where_doubling_stops_paying": True,
    }
    for t in result["tables"]:
        secs = t.pop("_seconds")
        if any(b > a * (1 + 1e-9) for a, b in zip(secs, secs[1:], strict=False)):
            out["time_never_grows_with_replicas"] = False
        if t.get("ceiling"):
            floor = t["ceiling"]["minimum_seconds"]
            out["ceiling_respected"] &= all(s >= floor for s in secs)
        by_n = dict(zip(replicas, secs, strict=False))
        k = t["knee_replicas"]
        if 2 * k in by_n and k in by_n:  # on the grid: the knee's doubling gains < 10%
            out["knee_is_where_doubling_stops_paying"] &= by_n[2 * k] > 0.9 * by_n[k]
        if t["prompts"] >= 10_000_000 and "self-hosted" in t["teacher"] and 1 in by_n and 64 in by_n:
            sp = by_n[1] / by_n[64]
            out["speedup_64_at_10m"] = min(sp, out["speedup_64_at_10m"] or math.inf)
    out["speedup_64_at_10m_ok"] = out["speedup_64_at_10m"] is None or out["speedup_64_at_10m"] >= MIN_SPEEDUP_64_AT_10M
    out["ok"] = all(
        out[k]
        for k in (
            "time_never_grows_with_replicas",
            "ceiling_respected",
            "knee_is_where_doubling_stops_paying",
            "speedup_64_at_10m_ok",
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompts", default="10000,1000000,10000000")
    args = ap.parse_args(argv)
    replicas = [int(x) for x in args.replicas.split(",")]
    prompts = [int(x) for x in args.prompts.split(",")]
    result = tables(replicas, prompts)
    result["checks"] = checks(result, replicas)
    print(json.dumps(result, indent=2))
    return 0 if result["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
