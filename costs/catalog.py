"""The pricing catalog: dated price entries with their source, read from a YAML file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

UNITS = ("host-hour", "gpu-hour", "million-tokens")


@dataclass(frozen=True)
class PriceEntry:
    key: str
    unit: str
    usd: float | None = None  # per host-hour or gpu-hour
    input_usd: float | None = None  # per million input tokens
    output_usd: float | None = None  # per million output tokens
    spot_usd: float | None = None
    batch_discount: float | None = None
    as_of: str = ""
    source: str = ""


class PricingError(ValueError):
    pass


def load_catalog(path: str | Path, overrides: dict[str, float] | None = None) -> dict[str, PriceEntry]:
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PricingError(f"cannot read pricing catalog {p}: {e}") from None
    entries = {}
    for key, e in (raw or {}).get("entries", {}).items():
        if e.get("unit") not in UNITS:
            raise PricingError(f"{p}: entries.{key}.unit must be one of {UNITS}, got {e.get('unit')!r}")
        fields = {k: e[k] for k in ("usd", "input_usd", "output_usd", "spot_usd", "batch_discount", "as_of", "source") if k in e}
        entries[key] = PriceEntry(key=key, unit=e["unit"], **fields)
    for key, usd in (overrides or {}).items():
        if key not in entries:
            raise PricingError(f"cost.overrides.{key}: no such entry in {p} (known: {sorted(entries)})")
        base = entries[key]
        if base.unit == "million-tokens":
            entries[key] = PriceEntry(**{**base.__dict__, "input_usd": usd, "output_usd": usd, "source": f"campaign override of {key}"})
        else:
            entries[key] = PriceEntry(**{**base.__dict__, "usd": usd, "source": f"campaign override of {key}"})
    return entries


def get(entries: dict[str, PriceEntry], key: str) -> PriceEntry:
    try:
        return entries[key]
    except KeyError:
        raise PricingError(f"no price entry {key!r} in the pricing catalog (known: {sorted(entries)})") from None
