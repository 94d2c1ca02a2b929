"""The teacher stage (``teacher_generations``) on 1..N Ray replicas (``execution.executor: ray``, ``campaign plan
--replicas``): time and dollars per replica count, an endpoint's rate-limit ceiling, and the knee past which more
replicas stop helping (:class:`ScaleOut`)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

from campaign_orchestrator.costs.catalog import Catalog, PriceEntry
from campaign_orchestrator.costs.memory import DTYPE_BYTES, ModelShape, PlanError
from campaign_orchestrator.costs.plan.facts import DataFacts
from campaign_orchestrator.costs.plan.roofline import (
    compute_dtype_on,
    decode_length,
    generation_seconds,
    hours_usd,
    perf,
)
from campaigns.spec import CampaignSpec


@dataclass
class ScaleRow:
    """One replica count: the stage's wall time and dollars (None: unpriced), against one replica."""

    replicas: int
    seconds: float
    usd: float | None
    speedup: float
    efficiency: float
    bound: str  # what limits it: "replicas", the shards, this host, the rate limit
    requests_per_s: float | None = None  # an endpoint's sustained rate


@dataclass
class ScaleOut:
    """The replica table of one stage. ``kind``: ``self-hosted`` (a model per replica) or ``endpoint`` (workers
    calling an API under its rate limits); the fields of the other kind stay None."""

    kind: str
    requests: int
    shards: int
    shard_prompts: int
    rows: list[ScaleRow]
    knee_replicas: int
    max_useful_replicas: int
    why_more_stop_helping: str
    ceiling: dict | None = None  # an endpoint's rate-limit ceiling: requests/s and /min, tokens/min, which binds
    # the stage as planned (plan_scaleout)
    stage: str | None = None
    executor: str | None = None
    configured_replicas: int | None = None
    assumptions: dict = field(default_factory=dict)
    # self-hosted
    shard_seconds: float | None = None
    model_load_seconds: float | None = None
    devices_per_replica: int | None = None
    usd_per_device_hour: float | None = None
    one_host_slots: int | None = None
    # the teacher's price entry
    price_key: str | None = None
    price_as_of: str | None = None
    price_source: str | None = None
    # endpoint
    request_latency_s: float | None = None
    first_token_s: float | None = None
    stream_tokens_per_s: float | None = None
    requests_per_s_per_replica: float | None = None
    max_concurrency_per_replica: int | None = None


DEFAULT_REPLICAS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ScaleAssumptions:
    """What the replica table assumes beyond the catalog (every figure is printed with the table).

    ``cluster_start_s``: bring-up of the Ray cluster before the first shard; by default by where Ray runs
    (``cluster_start_for``): 60 s for a KubeRay cluster (pods scheduled, a GPU image pulled, Ray started), 5 s for
    a local one, 0 for an existing one (``execution.ray_address``). ``shard_overhead_s``: per shard, on its
    replica: scheduling, the cache look-up and the shard's Parquet write. ``first_token_s`` and
    ``stream_tokens_per_s``: an endpoint's latency (time to the first token, then output tokens per second of one
    request), used when the catalog entry of ``teacher.price`` has no ``perf.first_token_s`` /
    ``perf.stream_tokens_per_s``. ``knee_gain``: the knee is the fewest replicas at which doubling them would cut
    the stage's time by less than this fraction."""

    cluster_start_s: float | None = None
    shard_overhead_s: float = 0.5
    first_token_s: float = 0.5
    stream_tokens_per_s: float = 50.0
    knee_gain: float = 0.10

    def with_overrides(self, pairs: dict[str, float]) -> ScaleAssumptions:
        unknown = sorted(set(pairs) - set(asdict(self)))
        if unknown:
            raise PlanError(f"unknown scale-out assumption(s) {unknown}; known: {sorted(asdict(self))}")
        return ScaleAssumptions(**(asdict(self) | {k: float(v) for k, v in pairs.items()}))


CLUSTER_START_S = {"kuberay": 60.0, "local": 5.0, "existing": 0.0}


def cluster_start_for(spec: CampaignSpec) -> float:
    """The default ``cluster_start_s`` for where ``spec``'s Ray cluster comes from."""
    ex = spec.execution
    return CLUSTER_START_S[
        "kuberay"
        if ex.kuberay is not None and not ex.kuberay.ray_cluster
        else "existing"
        if ex.ray_address or ex.kuberay is not None
        else "local"
    ]


def _knee(wall, max_replicas: int, gain: float) -> int:
    """The fewest replicas N at which doubling them cuts ``wall(N)`` by less than ``gain`` (searched up to
    ``max_replicas``, past which more replicas have nothing to do)."""
    n = 1
    while n < max_replicas:
        if wall(min(2 * n, max_replicas)) > (1 - gain) * wall(n):
            return n
        n += 1
    return max_replicas


def scale_self_hosted(
    *,
    requests: int,
    prompt_tokens: float,
    new_tokens: float,
    decode_tokens: float | None,
    shard_prompts: int,
    batch_size: int,
    params: int,
    weight_bytes: float,
    entry: PriceEntry,
    mfu: float,
    dtype: str,
    devices_per_replica: int,
    tier: str,
    replicas: list[int],
    assume: ScaleAssumptions,
    one_host_slots: int | None = None,
) -> ScaleOut:
    """Time and money of ``requests`` generations on N self-hosted replicas (one model each), sharded.

    A shard of ``shard_prompts`` takes the roofline time of one replica (:func:`generation_seconds` without the
    start-up) plus ``shard_overhead_s``; N replicas run ``ceil(shards / N)`` rounds after the cluster's start-up
    and one model load (in parallel). A replica of ``devices_per_replica`` devices (tensor parallelism) is taken
    as ideal: each device computes and reads 1/devices of the model. Every replica is billed for the whole stage,
    its idle tail included, so more replicas than the knee cost more for little time.

    ``one_host_slots``: CPU replicas of a local cluster, sharing one host of ``entry`` (its peak is the whole
    host's): each replica gets 1/slots of it, at most ``slots`` run at once, and the one host is billed."""
    shards = max(1, math.ceil(requests / shard_prompts)) if requests else 0
    per_shard = min(shard_prompts, requests) if requests else 0
    load_s = perf(entry, "generate_startup_s")
    slots = max(1, one_host_slots or 0)
    shard_s = (
        (
            generation_seconds(
                params / devices_per_replica,
                weight_bytes / devices_per_replica,
                per_shard,
                prompt_tokens,
                new_tokens,
                batch_size,
                entry,
                mfu,
                dtype,
                decode_tokens,
            )
            - load_s
        )
        * (slots if one_host_slots else 1)
        + assume.shard_overhead_s
        if shards
        else 0.0
    )
    parallel = (lambda n: min(n, slots)) if one_host_slots else (lambda n: n)

    def wall(n: int) -> float:
        return assume.cluster_start_s + load_s + math.ceil(shards / parallel(n)) * shard_s if shards else 0.0

    one = wall(1)
    rows = []
    for n in replicas:
        seconds = wall(n)
        billed = 1 if one_host_slots else n
        _qty, usd = hours_usd(entry, seconds, billed, billed * devices_per_replica, tier)
        bound = (
            "shards (replicas past the shard count idle)"
            if n > shards
            else f"this host ({slots} replica(s) at once)"
            if one_host_slots and n > slots
            else "replicas"
        )
        rows.append(
            ScaleRow(
                replicas=n,
                seconds=seconds,
                usd=usd,
                speedup=one / seconds if seconds else 1.0,
                efficiency=(one / seconds / n) if seconds else 1.0,
                bound=bound,
            )
        )
    useful = min(shards, slots) if one_host_slots else shards
    knee = _knee(wall, max(1, useful), assume.knee_gain)
    return ScaleOut(
        kind="self-hosted",
        requests=requests,
        shards=shards,
        shard_prompts=shard_prompts,
        shard_seconds=shard_s,
        model_load_seconds=load_s,
        devices_per_replica=devices_per_replica,
        price_key=entry.key,
        price_as_of=entry.as_of,
        price_source=entry.source,
        usd_per_device_hour=entry.hourly_usd(tier),
        rows=rows,
        knee_replicas=knee,
        max_useful_replicas=useful,
        ceiling=None,
        one_host_slots=one_host_slots,
        why_more_stop_helping=(
            f"past {knee} replica(s) a doubling cuts the time by less than "
            f"{assume.knee_gain:.0%}: "
            + (
                f"this host runs {slots} replica(s) at once (its CPUs)"
                if one_host_slots and knee >= useful
                else f"the fixed start-up ({assume.cluster_start_s + load_s:.0f} s) dominates "
                f"the {shards} shard(s) of {shard_s:.1f} s"
            )
            + f"; past {shards} replica(s) there is no shard left to run"
        ),
    )


def scale_endpoint(
    *,
    requests: int,
    prompt_tokens: float,
    new_tokens: float,
    max_new_tokens: int,
    shard_prompts: int,
    max_concurrency: int,
    requests_per_minute: int | None,
    tokens_per_minute: int | None,
    usd: float | None,
    replicas: list[int],
    assume: ScaleAssumptions,
    first_token_s: float | None = None,
    stream_tokens_per_s: float | None = None,
) -> ScaleOut:
    """Time of ``requests`` endpoint calls from N Ray workers, each with ``max_concurrency`` requests in flight, under
    the teacher's rate limits, which bind the whole job (one token bucket for every worker).

    One request takes ``first_token_s + new_tokens / stream_tokens_per_s``; a worker sustains ``max_concurrency``
    over that; the job sustains ``min(N x that, the ceiling)``, the ceiling being ``requests_per_minute`` and
    ``tokens_per_minute`` / (prompt + ``max_new_tokens``) tokens per request (what the client-side limiter counts).
    The dollars are the tokens' (the same for every N); the workers' own CPU time is not priced."""
    first = assume.first_token_s if first_token_s is None else first_token_s
    stream = assume.stream_tokens_per_s if stream_tokens_per_s is None else stream_tokens_per_s
    latency = first + new_tokens / stream
    per_replica = max_concurrency / latency  # requests/s one worker sustains
    ceilings = {}
    if requests_per_minute:
        ceilings["requests_per_minute"] = requests_per_minute / 60.0
    if tokens_per_minute:
        ceilings["tokens_per_minute"] = tokens_per_minute / 60.0 / (prompt_tokens + max_new_tokens)
    ceiling = min(ceilings.values()) if ceilings else None
    shards = max(1, math.ceil(requests / shard_prompts)) if requests else 0

    def rate(n: int) -> float:
        return min(n * per_replica, ceiling) if ceiling is not None else n * per_replica

    def wall(n: int) -> float:
        if not requests:
            return 0.0
        return assume.cluster_start_s + requests / rate(n) + math.ceil(shards / n) * assume.shard_overhead_s

    one = wall(1)
    rows = [
        ScaleRow(
            replicas=n,
            seconds=wall(n),
            usd=usd,
            requests_per_s=rate(n),
            speedup=one / wall(n) if wall(n) else 1.0,
            efficiency=(one / wall(n) / n) if wall(n) else 1.0,
            bound=(
                "rate limit"
                if ceiling is not None and n * per_replica >= ceiling
                else "shards (replicas past the shard count idle)"
                if n > shards
                else "replicas"
            ),
        )
        for n in replicas
    ]
    saturating = math.ceil(ceiling / per_replica) if ceiling is not None else None
    knee = _knee(wall, max(1, min(shards, saturating) if saturating else shards), assume.knee_gain)
    ceiling_md = (
        None
        if ceiling is None
        else {
            "requests_per_s": ceiling,
            "requests_per_minute": ceiling * 60,
            "tokens_per_minute": ceiling * 60 * (prompt_tokens + max_new_tokens),
            "binding": min(ceilings, key=ceilings.get),
            "replicas_to_reach_it": saturating,
            "minimum_seconds": requests / ceiling if requests else 0.0,
        }
    )
    why = (
        f"the rate limit ({ceiling * 60:,.0f} requests/min, set by teacher.{ceiling_md['binding']}) is reached "
        f"with {saturating} replica(s) of {per_replica * 60:,.0f} requests/min each; more only wait"
        if ceiling is not None
        else f"no rate limit is set, so only the start-up ({assume.cluster_start_s:.0f} s) and the {shards} shard(s) "
        f"bound it (the endpoint's own capacity is not modelled)"
    )
    return ScaleOut(
        kind="endpoint",
        requests=requests,
        shards=shards,
        shard_prompts=shard_prompts,
        request_latency_s=latency,
        first_token_s=first,
        stream_tokens_per_s=stream,
        requests_per_s_per_replica=per_replica,
        max_concurrency_per_replica=max_concurrency,
        rows=rows,
        knee_replicas=knee,
        max_useful_replicas=saturating or shards,
        ceiling=ceiling_md,
        why_more_stop_helping=why,
    )


def plan_scaleout(
    spec: CampaignSpec,
    catalog: Catalog,
    facts: DataFacts,
    teacher: ModelShape | None,
    replicas: list[int] | tuple[int, ...] | None = None,
    assume: ScaleAssumptions | None = None,
) -> ScaleOut:
    """The teacher stage (``teacher_generations``) on 1..N Ray replicas: time, dollars, and for an endpoint the rate
    limit's ceiling; where more replicas stop helping (``knee_replicas``). ``replicas`` default: 1, 2, 4, ... 64 and
    ``execution.replicas``."""
    from campaign_orchestrator.costs.catalog import teacher_entry

    t, ex, pl, c = spec.teacher, spec.execution, spec.cost.planner, spec.cost
    assume = assume or ScaleAssumptions()
    if assume.cluster_start_s is None:
        assume = ScaleAssumptions(**(asdict(assume) | {"cluster_start_s": cluster_start_for(spec)}))
    grid = sorted(set(replicas or DEFAULT_REPLICAS) | ({ex.replicas} if replicas is None else set()))
    if any(n < 1 for n in grid):
        raise PlanError(f"replica counts must be at least 1, got {grid}")
    requests = facts.train_prompts * t.sampling.n
    new_tok = t.sampling.max_new_tokens * pl.completion_fill
    p_tok = facts.prompt_tokens_teacher
    base = {
        "stage": "teacher_generations",
        "executor": ex.executor,
        "configured_replicas": ex.replicas,
        "assumptions": asdict(assume)
        | {
            "completion_fill": pl.completion_fill,
            "prompt_tokens": p_tok,
            "new_tokens": new_tok,
            "tokenizer": facts.tokenizer,
            "billing": "every replica on its own device (a host-hour entry: its own host), billed for the whole stage",
        },
    }
    entry = teacher_entry(spec, catalog)
    if t.api:
        usd = None
        if entry is not None:
            in_usd, out_usd = entry.token_usd(c.teacher_batch_api)
            usd = requests * (p_tok * in_usd + new_tok * out_usd) / 1e6
            base |= {"price_key": entry.key, "price_as_of": entry.as_of, "price_source": entry.source}
        entry_perf = entry.perf if entry is not None else {}
        return replace(
            scale_endpoint(
                requests=requests,
                prompt_tokens=p_tok,
                new_tokens=new_tok,
                max_new_tokens=t.sampling.max_new_tokens,
                shard_prompts=ex.shard_prompts,
                max_concurrency=t.max_concurrency,
                requests_per_minute=t.requests_per_minute,
                tokens_per_minute=t.tokens_per_minute,
                usd=usd,
                replicas=grid,
                assume=assume,
                first_token_s=entry_perf.get("first_token_s"),
                stream_tokens_per_s=entry_perf.get("stream_tokens_per_s"),
            ),
            **base,
        )
    if entry is None or teacher is None:
        raise PlanError("the scale-out table of a self-hosted teacher needs teacher.hardware and the teacher's config")
    tdt = compute_dtype_on(t.compute_dtype, entry)
    devices = max(t.tensor_parallel_size if t.backend == "vllm" else 1, math.ceil(ex.num_gpus_per_replica), 1)
    shared = facts.shared_prefix_tokens
    shard_n = min(ex.shard_prompts, requests) or 1
    p_eff = p_tok - shared * (1 - 1 / shard_n)  # a shard is one call: its prompts share the context prefix
    # CPU replicas of a local cluster share this host (its peak is the host's): at most cpus / cpus-per-replica at once
    local = ex.kuberay is None and not ex.ray_address and not ex.num_gpus_per_replica and entry.unit == "host-hour"
    slots = max(1, (os.cpu_count() or 1) // max(1, math.ceil(ex.num_cpus_per_replica))) if local else None
    if slots:
        base["assumptions"]["billing"] = (
            f"a local cluster: CPU replicas share this host ({os.cpu_count()} CPUs, "
            f"{slots} replica(s) at once), billed as one host"
        )
    return replace(
        scale_self_hosted(
            requests=requests,
            prompt_tokens=p_eff,
            new_tokens=new_tok,
            decode_tokens=decode_length(t.backend, t.sampling.temperature, t.sampling.max_new_tokens),
            shard_prompts=ex.shard_prompts,
            batch_size=t.batch_size,
            params=teacher.active_params,
            weight_bytes=teacher.params * DTYPE_BYTES[tdt],
            entry=entry,
            mfu=pl.generation_mfu,
            dtype=tdt,
            devices_per_replica=devices,
            tier=c.pricing_tier,
            replicas=grid,
            assume=assume,
            one_host_slots=slots,
        ),
        **base,
    )
