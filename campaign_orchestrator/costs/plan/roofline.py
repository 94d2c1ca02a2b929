"""Time and money on a catalog entry: the roofline of training steps and generation, the compute dtype a stage
resolves to, rows after packing, hours and dollars (the model is in :mod:`campaign_orchestrator.costs.plan`)."""

from __future__ import annotations

import math

from campaign_orchestrator.costs.catalog import PriceEntry
from campaign_orchestrator.costs.memory import PlanError
from campaigns.spec import CampaignSpec

PACKING_FILL = 0.95  # share of a packed row's max_seq_len best-fit-decreasing fills with short examples (measured)


def compute_dtype_on(spec_dtype: str, entry: PriceEntry) -> str:
    """The dtype a stage on ``entry`` computes in: ``auto`` resolved as the trainer resolves it (on a host
    with ``host_measured_peak``: this host's measurement; on a GPU entry: bf16)."""
    if entry.perf.get("host_measured_peak"):
        from campaign_orchestrator.hardware import resolve_compute_dtype

        return resolve_compute_dtype(spec_dtype, "cpu").dtype
    return "bfloat16" if spec_dtype == "auto" else spec_dtype


def peak_flops(entry: PriceEntry, dtype: str) -> float:
    """FLOP/s of one device of ``entry`` in ``dtype``: this host's measured matmul peak where the entry asks
    for it, else the catalog's figure (fp32: ``fp32_peak_tflops``, else a quarter of the bf16 peak)."""
    if entry.perf.get("host_measured_peak"):
        from campaign_orchestrator.hardware import measure_cpu_peak

        return measure_cpu_peak().gflops(dtype) * 1e9
    if dtype == "float32":
        return float(entry.perf.get("fp32_peak_tflops") or perf(entry, "peak_tflops") / 4) * 1e12
    return perf(entry, "peak_tflops") * 1e12


def perf(entry: PriceEntry, key: str) -> float:
    """The catalog entry's ``perf.<key>``; a PlanError naming the entry and the field when it has none."""
    try:
        return float(entry.perf[key])
    except KeyError:
        raise PlanError(
            f"pricing catalog entry {entry.key!r} has no perf.{key}; add it to plan stages on this hardware"
        ) from None


def generation_seconds(
    params: int,
    weight_bytes: float,
    prompts: int,
    prompt_tokens: float,
    new_tokens: float,
    batch_size: int,
    entry: PriceEntry,
    mfu: float,
    dtype: str = "bfloat16",
    decode_tokens: float | None = None,
) -> float:
    """Roofline time to answer ``prompts`` prompts on one device (see the package docstring): ``new_tokens`` is
    the mean answer's length, ``decode_tokens`` (default: the same) the length a batch decodes to, which its
    longest answer sets on ``generate`` (every row of the batch computes until the last one stops: see
    :func:`decode_length`)."""
    if not prompts:
        return 0.0  # nothing to answer: no model is loaded
    batches = math.ceil(prompts / batch_size)
    decoded = new_tokens if decode_tokens is None else max(new_tokens, decode_tokens)
    flops = 2 * params * prompts * (prompt_tokens + decoded)
    compute = flops / (peak_flops(entry, dtype) * mfu)
    decode_steps = batches * decoded
    memory = decode_steps * weight_bytes / (perf(entry, "memory_bandwidth_gbps") * 1e9)
    return (
        max(compute, memory) + decode_steps * perf(entry, "decode_step_overhead_s") + perf(entry, "generate_startup_s")
    )


def decode_length(backend: str, temperature: float, max_new_tokens: int) -> int | None:
    """What a batch decodes to (:func:`generation_seconds`' ``decode_tokens``): None (each answer its own length)
    where rows leave the batch as they finish: vLLM (continuous batching) and greedy local requests (the
    ``transformers`` backend's continuous engine, ``auto``'s choice in every dtype); ``max_new_tokens`` for sampled
    local requests, which ``generate`` decodes until the batch's longest answer ends. (The measurement switch
    ``$CAMPAIGN_GENERATION_ENGINE=hf_generate`` is not planned for.)"""
    return max_new_tokens if backend == "transformers" and temperature > 0 else None


def packed_rows(spec: CampaignSpec, prompt_tokens: float, new_tokens: float, examples: float) -> tuple[float, float]:
    """(tokens per training row, rows): an example is its rendered prompt (``prompt_tokens``, the student's), its
    completion and the stop token; with ``dataset.packing`` rows hold several examples, up to ``max_seq_len``."""
    tr = spec.training
    example = min(tr.max_seq_len, prompt_tokens + new_tokens + 1)
    if not spec.dataset.packing or example >= tr.max_seq_len * PACKING_FILL:
        return example, examples
    row = tr.max_seq_len * PACKING_FILL
    return row, max(1.0, math.ceil(examples * example / row))


def hours_usd(entry: PriceEntry, seconds: float, hosts: int, devices: int, tier: str) -> tuple[float, float]:
    """(billed hours, dollars) of ``seconds`` on ``entry``: per host or per device as the entry is priced."""
    qty = seconds / 3600 * (hosts if entry.unit == "host-hour" else devices)
    return qty, qty * entry.hourly_usd(tier)
