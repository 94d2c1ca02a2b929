"""Cost lines: what one stage spent, in a unit with a dated unit price.

A line is a plain dict so it can sit in a stage manifest (JSON) and, later, in the ledger.
"""

from __future__ import annotations

from costs.catalog import PriceEntry, PricingError


def compute_line(kind: str, entry: PriceEntry, seconds: float, hosts: int = 1, devices: int = 1) -> dict:
    """Cost of running ``seconds`` on hardware ``entry`` (host-hour × hosts, gpu-hour × devices)."""
    if entry.usd is None:
        raise PricingError(f"price entry {entry.key!r} has no hourly price")
    if entry.unit == "host-hour":
        qty = seconds / 3600 * hosts
    elif entry.unit == "gpu-hour":
        qty = seconds / 3600 * devices
    else:
        raise PricingError(f"price entry {entry.key!r} is per {entry.unit}, not per hour")
    return {"kind": kind, "price_key": entry.key, "quantity": qty, "unit": entry.unit, "unit_price": entry.usd,
            "usd": qty * entry.usd, "as_of": entry.as_of}


def token_lines(kind: str, entry: PriceEntry, input_tokens: int, output_tokens: int) -> list[dict]:
    if entry.unit != "million-tokens":
        raise PricingError(f"price entry {entry.key!r} is per {entry.unit}, not per million tokens")
    out = []
    for what, n, price in (("input", input_tokens, entry.input_usd), ("output", output_tokens, entry.output_usd)):
        if price is None:
            raise PricingError(f"price entry {entry.key!r} has no {what} price")
        out.append({"kind": kind, "price_key": f"{entry.key}:{what}", "quantity": n / 1e6, "unit": "million-tokens",
                    "unit_price": price, "usd": n / 1e6 * price, "as_of": entry.as_of})
    return out


def total(lines: list[dict]) -> float:
    return sum(line["usd"] for line in lines)
