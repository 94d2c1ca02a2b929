"""Cost lines: what one stage spent, in a unit with a dated unit price.

A line is a plain dict so it can sit in a stage manifest (JSON) and in the ledger::

    {"kind": "training", "price_key": "h100-sxm", "quantity": 1.5, "unit": "gpu-hour",
     "unit_price": 2.99, "usd": 4.485, "as_of": "2026-01-15", "tier": "on_demand",
     "catalog_version": "2026-11-29"}

``kind`` is what the money bought (teacher, training, evaluation), the split cost reports use.
"""

from __future__ import annotations

from campaign_orchestrator.costs.catalog import PriceEntry, PricingError

TIERS = ("on_demand", "spot")


def _stamp(line: dict, entry: PriceEntry, tier: str) -> dict:
    return {**line, "as_of": entry.as_of, "tier": tier, "catalog_version": entry.catalog_version}


def compute_line(kind: str, entry: PriceEntry, seconds: float, hosts: int = 1, devices: int = 1,
                 tier: str = "on_demand") -> dict:
    """Cost of running ``seconds`` on hardware ``entry`` (host-hour × hosts, gpu-hour × devices)."""
    if tier not in TIERS:
        raise PricingError(f"pricing tier must be one of {TIERS}, got {tier!r}")
    price = entry.hourly_usd(tier)
    if entry.unit == "host-hour":
        qty = seconds / 3600 * hosts
    elif entry.unit == "gpu-hour":
        qty = seconds / 3600 * devices
    else:
        raise PricingError(f"price entry {entry.key!r} is per {entry.unit}, not per hour")
    return _stamp({"kind": kind, "price_key": entry.key, "quantity": qty, "unit": entry.unit, "unit_price": price,
                   "usd": qty * price}, entry, tier)


def token_lines(kind: str, entry: PriceEntry, input_tokens: int, output_tokens: int, batch: bool = False) -> list[dict]:
    """Two lines (input, output) for an API priced per million tokens; ``batch`` applies its discount."""
    in_usd, out_usd = entry.token_usd(batch)
    tier = "batch" if batch else "on_demand"
    return [_stamp({"kind": kind, "price_key": f"{entry.key}:{what}", "quantity": n / 1e6, "unit": "million-tokens",
                    "unit_price": price, "usd": n / 1e6 * price}, entry, tier)
            for what, n, price in (("input", input_tokens, in_usd), ("output", output_tokens, out_usd))]


def usage_lines(kind: str, entry: PriceEntry, seconds: float, input_tokens: int = 0, output_tokens: int = 0,
                hosts: int = 1, devices: int = 1, tier: str = "on_demand", batch: bool = False) -> list[dict]:
    """Lines for a stage whatever its entry's unit: time for hardware, tokens for an API."""
    if entry.hourly:
        return [compute_line(kind, entry, seconds, hosts=hosts, devices=devices, tier=tier)]
    return token_lines(kind, entry, input_tokens, output_tokens, batch=batch)


def total(lines: list[dict]) -> float:
    return float(sum(line["usd"] for line in lines))


# --------------------------------------------------------------------------- the teacher's one price field


def teacher_entry(spec, catalog) -> PriceEntry | None:
    """The one catalog entry that prices ``spec``'s teacher: ``teacher.price`` for an API teacher (per
    million tokens), ``teacher.hardware`` for a self-hosted one (hourly); None for ``price: unpriced``.
    The budget guard, the planner and the recorded cost all read it here."""
    key = spec.teacher.price_key
    if key is None:
        return None
    entry = catalog.get(key)
    field = "teacher.price" if spec.teacher.api else "teacher.hardware"
    if spec.teacher.api and entry.unit != "million-tokens":
        raise PricingError(f"{field} {key!r} is priced per {entry.unit}; an API teacher needs an entry priced per "
                           "million tokens (unit million-tokens, input_usd and output_usd)")
    if not spec.teacher.api and not entry.hourly:
        raise PricingError(f"{field} {key!r} is priced per {entry.unit}; a self-hosted teacher runs on hardware "
                           "priced per hour (unit gpu-hour or host-hour)")
    return entry


def teacher_lines(spec, catalog, seconds: float, input_tokens: int, output_tokens: int, kind: str = "teacher"
                  ) -> list[dict] | None:
    """What the teacher's work cost: tokens x the API's prices, or seconds on its hardware (x GPUs for vLLM
    tensor parallelism); None when the teacher is unpriced (the spend is unknown, never $0)."""
    entry = teacher_entry(spec, catalog)
    if entry is None:
        return None
    t, c = spec.teacher, spec.cost
    devices = t.tensor_parallel_size if t.backend == "vllm" else 1
    return usage_lines(kind, entry, seconds, input_tokens, output_tokens, devices=devices, tier=c.pricing_tier,
                       batch=c.teacher_batch_api)


def price_problems(spec, catalog) -> list[str]:
    """What in ``spec`` the pricing catalog cannot price (empty: every priced field has a fitting entry)."""
    problems = []
    try:
        teacher_entry(spec, catalog)
    except PricingError as e:
        problems.append(str(e))
    for field, key in (("training.hardware", spec.training.hardware),
                       ("training.cpu_hardware", getattr(spec.training, "cpu_hardware", None))):
        if key is None:
            continue
        try:
            entry = catalog.get(key)
        except PricingError as e:
            problems.append(f"{field}: {e}")
            continue
        if not entry.hourly:
            problems.append(f"{field} {key!r} is priced per {entry.unit}; training runs on hardware priced per hour")
    return problems


# --------------------------------------------------------------------------- billed hardware is the hardware used


def gpu_priced(spec, catalog) -> bool:
    """``training.hardware`` is a GPU (priced per GPU-hour): training must find one."""
    return catalog.get(spec.training.hardware).unit == "gpu-hour"


def billed_hardware(spec, catalog, device_type: str, what: str = "training") -> tuple[str, str | None]:
    """The catalog key to bill ``what`` at, having run on ``device_type`` ("cuda" or "cpu"), and a note
    when it is not ``training.hardware``. GPU hardware but no GPU: ``training.cpu_hardware`` with
    ``allow_cpu_fallback``, else :class:`PricingError` (never CPU time billed as GPU time)."""
    tr = spec.training
    if device_type == "cuda" or not gpu_priced(spec, catalog):
        return tr.hardware, None
    if not tr.allow_cpu_fallback:
        raise PricingError(f"training.hardware {tr.hardware!r} is priced per GPU-hour but {what} found no GPU here "
                           "(torch sees none): refusing to run on the CPU and bill it as GPU time; run where the GPU "
                           "is visible, or set training.allow_cpu_fallback: true with training.cpu_hardware")
    return tr.cpu_hardware, (f"{what} found no GPU and ran on the CPU (training.allow_cpu_fallback): billed as CPU "
                             f"time at {tr.cpu_hardware}, not at {tr.hardware}")
