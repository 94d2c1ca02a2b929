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
