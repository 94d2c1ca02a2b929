"""The pricing catalog: dated price entries with their source, read from a versioned YAML file.

Format (``campaigns/pricing/catalog.yaml``)::

    version: "2026-11-29"            # the catalog's version; a campaign may pin it (cost.catalog_version)
    entries:
      h100-sxm:
        unit: gpu-hour               # gpu-hour | host-hour | million-tokens
        memory_gb: 80                # device memory, for the planner's "does it fit"
        perf: {peak_tflops: 989, memory_bandwidth_gbps: 3350}   # planner assumptions (optional)
        prices:                      # dated prices; the latest with as_of <= the pricing date applies
          - {as_of: "2025-06-01", usd: 3.50, spot_usd: 2.40, source: "..."}
          - {as_of: "2026-01-15", usd: 2.99, spot_usd: 2.10, source: "..."}
      api-open-70b:
        unit: million-tokens
        prices:
          - {as_of: "2026-01-15", input_usd: 0.88, output_usd: 0.88, batch_discount: 0.5, source: "..."}

A single price may also sit directly on the entry (``usd``, ``as_of``, ``source`` ...) instead of
under ``prices``. No price lives in code: every dollar figure the project prints comes from here
or from a campaign's ``cost.overrides``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

UNITS = ("host-hour", "gpu-hour", "million-tokens")
PRICE_FIELDS = ("usd", "spot_usd", "input_usd", "output_usd", "batch_discount")
PERF_FIELDS = ("peak_tflops", "fp32_peak_tflops", "memory_bandwidth_gbps", "step_overhead_s", "decode_step_overhead_s",
               "train_startup_s", "generate_startup_s", "runtime_gb", "host_measured_peak", "heap_retention",
               "heap_retention_jemalloc")


class PricingError(ValueError):
    pass


@dataclass(frozen=True)
class PriceEntry:
    """One priced resource at one date. Hourly entries use ``usd``/``spot_usd``; token entries use
    ``input_usd``/``output_usd`` per million tokens and an optional ``batch_discount`` (0.5 = half)."""

    key: str
    unit: str
    usd: float | None = None
    input_usd: float | None = None
    output_usd: float | None = None
    spot_usd: float | None = None
    batch_discount: float | None = None
    as_of: str = ""
    source: str = ""
    catalog_version: str = ""
    memory_gb: float | None = None
    perf: dict[str, float] = field(default_factory=dict)

    @property
    def hourly(self) -> bool:
        return self.unit in ("host-hour", "gpu-hour")

    def hourly_usd(self, tier: str = "on_demand") -> float:
        """$/hour for ``tier`` ("on_demand" or "spot")."""
        if not self.hourly:
            raise PricingError(f"price entry {self.key!r} is per {self.unit}, not per hour")
        price = self.spot_usd if tier == "spot" else self.usd
        if price is None:
            what = "spot_usd" if tier == "spot" else "usd"
            raise PricingError(f"price entry {self.key!r} has no {what} (needed for pricing tier {tier!r})")
        return float(price)

    def token_usd(self, batch: bool = False) -> tuple[float, float]:
        """($/M input tokens, $/M output tokens), with the batch discount applied when ``batch``."""
        if self.unit != "million-tokens":
            raise PricingError(f"price entry {self.key!r} is per {self.unit}, not per million tokens")
        if self.input_usd is None or self.output_usd is None:
            raise PricingError(f"price entry {self.key!r} needs both input_usd and output_usd")
        factor = 1.0 - (self.batch_discount or 0.0) if batch else 1.0
        return float(self.input_usd) * factor, float(self.output_usd) * factor


@dataclass(frozen=True)
class Catalog:
    path: str
    version: str
    entries: dict[str, PriceEntry]
    undated: dict[str, str] = field(default_factory=dict)  # key -> why it has no price on the pricing date

    def get(self, key: str) -> PriceEntry:
        try:
            return self.entries[key]
        except KeyError:
            if key in self.undated:
                raise PricingError(self.undated[key]) from None
            raise PricingError(f"no price entry {key!r} in the pricing catalog {self.path} "
                               f"(known: {', '.join(sorted(self.entries))})") from None


def _num(p: Path, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise PricingError(f"{p}: {where} must be a non-negative number, got {value!r}")
    return float(value)


def _date(p: Path, where: str, value: Any) -> str:
    s = str(value)
    try:
        dt.date.fromisoformat(s)
    except ValueError:
        raise PricingError(f"{p}: {where} must be a date YYYY-MM-DD, got {value!r}") from None
    return s


def _pick_price(p: Path, key: str, raw: dict, on: str) -> dict | None:
    """The dated price that applies ``on`` (YYYY-MM-DD): the latest with ``as_of <= on`` (None: none yet)."""
    dated = raw.get("prices")
    if dated is None:
        flat = {k: raw[k] for k in (*PRICE_FIELDS, "as_of", "source") if k in raw}
        dated = [flat]
    if not isinstance(dated, list) or not dated:
        raise PricingError(f"{p}: entries.{key}.prices must be a non-empty list of dated prices")
    checked = []
    for i, d in enumerate(dated):
        where = f"entries.{key}.prices[{i}]" if "prices" in raw else f"entries.{key}"
        if not isinstance(d, dict):
            raise PricingError(f"{p}: {where} must be a mapping with as_of, source and prices")
        unknown = set(d) - {*PRICE_FIELDS, "as_of", "source"}
        if unknown:
            raise PricingError(f"{p}: {where}: unknown key(s) {sorted(unknown)}; expected {[*PRICE_FIELDS, 'as_of', 'source']}")
        if "as_of" not in d or not d.get("source"):
            raise PricingError(f"{p}: {where} needs `as_of` (date) and `source` (where the price comes from)")
        checked.append({**{k: _num(p, f"{where}.{k}", d[k]) for k in PRICE_FIELDS if k in d},
                        "as_of": _date(p, f"{where}.as_of", d["as_of"]), "source": str(d["source"])})
    valid = [d for d in checked if d["as_of"] <= on]
    return max(valid, key=lambda d: d["as_of"]) if valid else None


def _override(base: PriceEntry, value: float | dict, path: Path) -> PriceEntry:
    src = f"campaign override of {base.key}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if base.unit == "million-tokens":
            return replace(base, input_usd=float(value), output_usd=float(value), source=src)
        return replace(base, usd=float(value), spot_usd=float(value), source=src)
    if isinstance(value, dict):
        unknown = set(value) - {*PRICE_FIELDS, "source", "as_of"}
        if unknown:
            raise PricingError(f"cost.overrides.{base.key}: unknown key(s) {sorted(unknown)}; expected {list(PRICE_FIELDS)}")
        fields = {k: _num(path, f"cost.overrides.{base.key}.{k}", v) for k, v in value.items() if k in PRICE_FIELDS}
        return replace(base, **fields, source=str(value.get("source", src)), as_of=str(value.get("as_of", base.as_of)))
    raise PricingError(f"cost.overrides.{base.key}: expected a number (USD per {base.unit}) or a mapping of "
                       f"{list(PRICE_FIELDS)}, got {value!r}")


def read_catalog(path: str | Path, overrides: dict[str, float | dict] | None = None, on: str | None = None,
                 expect_version: str | None = None) -> Catalog:
    """Read and validate a catalog; apply a campaign's overrides; pick each entry's price dated ``on``
    (default: today, UTC). ``expect_version`` pins the catalog version a campaign was planned with."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise PricingError(f"cannot read pricing catalog {p}: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("entries"), dict):
        raise PricingError(f"{p}: expected a mapping with `version` and `entries`")
    version = str(raw.get("version", ""))
    if not version:
        raise PricingError(f"{p}: `version` is required (e.g. \"2026-11-29\"); ledger lines record it")
    if expect_version is not None and expect_version != version:
        raise PricingError(f"{p} is catalog version {version!r} but the campaign pins cost.catalog_version "
                           f"{expect_version!r}; update the pin after reviewing the new prices")
    on = on or dt.datetime.now(dt.UTC).date().isoformat()
    entries: dict[str, PriceEntry] = {}
    undated: dict[str, str] = {}
    for key, e in raw["entries"].items():
        if not isinstance(e, dict):
            raise PricingError(f"{p}: entries.{key} must be a mapping")
        if e.get("unit") not in UNITS:
            raise PricingError(f"{p}: entries.{key}.unit must be one of {UNITS}, got {e.get('unit')!r}")
        price = _pick_price(p, key, e, on)
        if price is None:
            undated[key] = f"{p}: entries.{key} has no price dated on or before {on}"
            continue
        perf = e.get("perf") or {}
        if not isinstance(perf, dict) or set(perf) - set(PERF_FIELDS):
            raise PricingError(f"{p}: entries.{key}.perf must be a mapping of {PERF_FIELDS}, got {perf!r}")
        entries[key] = PriceEntry(
            key=key, unit=e["unit"], catalog_version=version,
            memory_gb=_num(p, f"entries.{key}.memory_gb", e["memory_gb"]) if "memory_gb" in e else None,
            perf={k: _num(p, f"entries.{key}.perf.{k}", v) for k, v in perf.items()}, **price)
        if entries[key].hourly and entries[key].usd is None:
            raise PricingError(f"{p}: entries.{key} is per {e['unit']} and needs `usd` (on-demand)")
        if not entries[key].hourly and (entries[key].input_usd is None or entries[key].output_usd is None):
            raise PricingError(f"{p}: entries.{key} is per million tokens and needs `input_usd` and `output_usd`")
    for key, value in (overrides or {}).items():
        if key in undated:
            raise PricingError(undated[key])
        if key not in entries:
            raise PricingError(f"cost.overrides.{key}: no such entry in {p} (known: {', '.join(sorted(entries))})")
        entries[key] = _override(entries[key], value, p)
    return Catalog(str(p), version, entries, undated)


def load_catalog(path: str | Path, overrides: dict[str, float | dict] | None = None) -> dict[str, PriceEntry]:
    """The catalog's entries by key (today's prices, with overrides)."""
    return read_catalog(path, overrides).entries


def get(entries: dict[str, PriceEntry], key: str) -> PriceEntry:
    try:
        return entries[key]
    except KeyError:
        raise PricingError(f"no price entry {key!r} in the pricing catalog (known: {sorted(entries)})") from None
