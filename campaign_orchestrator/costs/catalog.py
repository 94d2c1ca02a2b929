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
        top_logprobs: 20             # optional: the most top-k log-probabilities per token the API returns
                                     # (0: none); `campaign validate` refuses logit distillation beyond it
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
PERF_FIELDS = (
    "peak_tflops",
    "fp32_peak_tflops",
    "memory_bandwidth_gbps",
    "step_overhead_s",
    "decode_step_overhead_s",
    "train_startup_s",
    "generate_startup_s",
    "runtime_gb",
    "host_measured_peak",
    "heap_retention",
    "heap_retention_jemalloc",
)


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
            raise PricingError(
                f"no price entry {key!r} in the pricing catalog {self.path} (known: {', '.join(sorted(self.entries))})"
            ) from None


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
            raise PricingError(
                f"{p}: {where}: unknown key(s) {sorted(unknown)}; expected {[*PRICE_FIELDS, 'as_of', 'source']}"
            )
        if "as_of" not in d or not d.get("source"):
            raise PricingError(f"{p}: {where} needs `as_of` (date) and `source` (where the price comes from)")
        checked.append(
            {
                **{k: _num(p, f"{where}.{k}", d[k]) for k in PRICE_FIELDS if k in d},
                "as_of": _date(p, f"{where}.as_of", d["as_of"]),
                "source": str(d["source"]),
            }
        )
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
            raise PricingError(
                f"cost.overrides.{base.key}: unknown key(s) {sorted(unknown)}; expected {list(PRICE_FIELDS)}"
            )
        fields = {k: _num(path, f"cost.overrides.{base.key}.{k}", v) for k, v in value.items() if k in PRICE_FIELDS}
        return replace(base, **fields, source=str(value.get("source", src)), as_of=str(value.get("as_of", base.as_of)))
    raise PricingError(
        f"cost.overrides.{base.key}: expected a number (USD per {base.unit}) or a mapping of "
        f"{list(PRICE_FIELDS)}, got {value!r}"
    )


def read_catalog(
    path: str | Path,
    overrides: dict[str, float | dict] | None = None,
    on: str | None = None,
    expect_version: str | None = None,
) -> Catalog:
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
        raise PricingError(f'{p}: `version` is required (e.g. "2026-11-29"); ledger lines record it')
    if expect_version is not None and expect_version != version:
        raise PricingError(
            f"{p} is catalog version {version!r} but the campaign pins cost.catalog_version "
            f"{expect_version!r}; update the pin after reviewing the new prices"
        )
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
        top = e.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0 or e["unit"] != UNITS[2]):
            raise PricingError(
                f"{p}: entries.{key}.top_logprobs is what an API (unit million-tokens) returns at most per token: "
                f"an integer >= 0 (0: no log-probabilities), got {top!r} on a {e['unit']} entry"
            )
        perf = e.get("perf") or {}
        if not isinstance(perf, dict) or set(perf) - set(PERF_FIELDS):
            raise PricingError(f"{p}: entries.{key}.perf must be a mapping of {PERF_FIELDS}, got {perf!r}")
        entries[key] = PriceEntry(
            key=key,
            unit=e["unit"],
            catalog_version=version,
            memory_gb=_num(p, f"entries.{key}.memory_gb", e["memory_gb"]) if "memory_gb" in e else None,
            perf={k: _num(p, f"entries.{key}.perf.{k}", v) for k, v in perf.items()},
            **price,
        )
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


# =========================================================================== cost lines
# A line is a plain dict so it can sit in a stage manifest (JSON) and in the ledger::
#
#     {"kind": "training", "price_key": "h100-sxm", "quantity": 1.5, "unit": "gpu-hour",
#      "unit_price": 2.99, "usd": 4.485, "as_of": "2026-01-15", "tier": "on_demand",
#      "catalog_version": "2026-11-29"}
#
# ``kind`` is what the money bought (teacher, training, evaluation), the split cost reports use.
# The line functions sit beside the entries they price, so that billing a stage stays in this module.

TIERS = ("on_demand", "spot")


def _stamp(line: dict, entry: PriceEntry, tier: str) -> dict:
    return {**line, "as_of": entry.as_of, "tier": tier, "catalog_version": entry.catalog_version}


def compute_line(
    kind: str, entry: PriceEntry, seconds: float, hosts: int = 1, devices: int = 1, tier: str = "on_demand"
) -> dict:
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
    return _stamp(
        {
            "kind": kind,
            "price_key": entry.key,
            "quantity": qty,
            "unit": entry.unit,
            "unit_price": price,
            "usd": qty * price,
        },
        entry,
        tier,
    )


def token_lines(kind: str, entry: PriceEntry, input_tokens: int, output_tokens: int, batch: bool = False) -> list[dict]:
    """Two lines (input, output) for an API priced per million tokens; ``batch`` applies its discount."""
    in_usd, out_usd = entry.token_usd(batch)
    tier = "batch" if batch else "on_demand"
    return [
        _stamp(
            {
                "kind": kind,
                "price_key": f"{entry.key}:{what}",
                "quantity": n / 1e6,
                "unit": "million-tokens",
                "unit_price": price,
                "usd": n / 1e6 * price,
            },
            entry,
            tier,
        )
        for what, n, price in (("input", input_tokens, in_usd), ("output", output_tokens, out_usd))
    ]


def usage_lines(
    kind: str,
    entry: PriceEntry,
    seconds: float,
    input_tokens: int = 0,
    output_tokens: int = 0,
    hosts: int = 1,
    devices: int = 1,
    tier: str = "on_demand",
    batch: bool = False,
) -> list[dict]:
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
    api = spec.teacher.api
    field = "teacher.price" if api else "teacher.hardware"
    if api and entry.unit != "million-tokens":
        raise PricingError(
            f"{field} {key!r} is priced per {entry.unit}; an API teacher needs an entry priced per "
            "million tokens (unit million-tokens, input_usd and output_usd)"
        )
    if not api and not entry.hourly:
        raise PricingError(
            f"{field} {key!r} is priced per {entry.unit}; a self-hosted teacher runs on hardware "
            "priced per hour (unit gpu-hour or host-hour)"
        )
    return entry


def teacher_lines(
    spec, catalog, seconds: float, input_tokens: int, output_tokens: int, kind: str = "teacher"
) -> list[dict] | None:
    """What the teacher's work cost: tokens x the API's prices, or seconds on its hardware (x GPUs for vLLM
    tensor parallelism); None when the teacher is unpriced (the spend is unknown, never $0)."""
    entry = teacher_entry(spec, catalog)
    if entry is None:
        return None
    t, c = spec.teacher, spec.cost
    devices = t.tensor_parallel_size if t.backend == "vllm" else 1
    return usage_lines(
        kind,
        entry,
        seconds,
        input_tokens,
        output_tokens,
        devices=devices,
        tier=c.pricing_tier,
        batch=c.teacher_batch_api,
    )


def price_problems(spec, catalog) -> list[str]:
    """What in ``spec`` the pricing catalog cannot price (empty: every priced field has a fitting entry)."""
    problems = []
    try:
        teacher_entry(spec, catalog)
    except PricingError as e:
        problems.append(str(e))
    for where, key in (
        ("training.hardware", spec.training.hardware),
        ("training.cpu_hardware", getattr(spec.training, "cpu_hardware", None)),
    ):
        if key is None:
            continue
        try:
            entry = catalog.get(key)
        except PricingError as e:
            problems.append(f"{where}: {e}")
            continue
        if not entry.hourly:
            problems.append(f"{where} {key!r} is priced per {entry.unit}; training runs on hardware priced per hour")
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
        raise PricingError(
            f"training.hardware {tr.hardware!r} is priced per GPU-hour but {what} found no GPU here "
            "(torch sees none): refusing to run on the CPU and bill it as GPU time; run where the GPU "
            "is visible, or set training.allow_cpu_fallback: true with training.cpu_hardware"
        )
    return tr.cpu_hardware, (
        f"{what} found no GPU and ran on the CPU (training.allow_cpu_fallback): billed as CPU "
        f"time at {tr.cpu_hardware}, not at {tr.hardware}"
    )


# --------------------------------------------------------------------------- one stage's bill

# stage -> what its money buys (a line's kind), and whether its hardware time counts hosts and devices
STAGE_KIND = {
    "teacher_generations": "teacher",
    "teacher_scoring": "evaluation",
    "student_adapter": "training",
    "hparam_sweep": "training",
    "evaluation": "evaluation",
    "drift_evaluation": "evaluation",
    "on_policy_scoring": "teacher",
}
TEACHER_STAGES = ("teacher_generations", "teacher_scoring")
ON_POLICY_SCORING = "on_policy_scoring"  # the teacher's prefills of the student's samples, inside student_adapter
USAGE_FIELDS = ("seconds", "prompt_tokens", "completion_tokens", "device", "hardware", "parts", "rounds")


def on_policy_scoring_lines(
    spec, catalog: Catalog, prefill_tokens: int, completion_tokens: int = 0
) -> tuple[list[dict] | None, str | None]:
    """(lines, note) of the teacher scoring the student's samples (on-policy distillation): an API teacher
    (``teacher.price``) bills the prefills (prompt + sample) at its *input* price, and what it generated besides
    (the one token per request vLLM needs) at its output price; a self-hosted teacher scores in process on the
    training host, whose time the training line already bills: no line of its own. None: ``price: unpriced``."""
    entry = teacher_entry(spec, catalog)
    if entry is None:
        return None, None
    if not spec.teacher.api:
        return [], (
            f"the teacher scored the student's samples in process ({spec.teacher.backend}): its time is "
            "billed in the training line"
        )
    lines = token_lines("teacher", entry, prefill_tokens, completion_tokens, batch=spec.cost.teacher_batch_api)
    return [line for line in lines if line["quantity"] > 0 or line["price_key"].endswith(":input")], None


def _on_policy_bill(spec, catalog: Catalog, usage: dict) -> dict:
    """``stage_bill`` of ``on_policy_scoring``: ``rounds`` (the trainer's per-round rows: ``round``,
    ``teacher_prefill_tokens``, optional ``teacher_completion_tokens``) gives one set of lines per round, each line
    stamped with its ``round`` (``parts_usd``: dollars per round); or ``prompt_tokens``/``completion_tokens``."""
    rounds = usage.get("rounds")
    if rounds is None:
        rounds = [
            {
                "round": None,
                "teacher_prefill_tokens": int(usage.get("prompt_tokens", 0)),
                "teacher_completion_tokens": int(usage.get("completion_tokens", 0)),
            }
        ]
    lines: list[dict] | None = []
    note, parts = None, {}
    for r in rounds:
        got, note = on_policy_scoring_lines(
            spec, catalog, int(r.get("teacher_prefill_tokens", 0)), int(r.get("teacher_completion_tokens", 0))
        )
        if got is None:
            lines = None
            break
        if r.get("round") is not None:
            got = [line | {"round": int(r["round"])} for line in got]
            parts[f"round {int(r['round'])}"] = total(got)
        lines += got
    return {
        "lines": lines,
        "usd": None if lines is None else total(lines),
        "billed_hardware": None,
        "billing_note": note,
        "parts_usd": parts if lines is not None else {},
    }


def catalog_for(spec, path: str | Path) -> Catalog:
    """The catalog at ``path`` with ``spec``'s overrides, pinned to its ``cost.catalog_version``."""
    c = spec.cost
    return read_catalog(path, c.price_overrides(), expect_version=c.catalog_version)


def bill_at(spec, path: str | Path, stage: str, usage: dict) -> dict:
    """``stage_bill`` with the catalog at ``path`` (read with ``spec``'s overrides and pin: ``catalog_for``)."""
    return stage_bill(spec, catalog_for(spec, path), stage, usage)


def stage_bill(spec, catalog: Catalog, stage: str, usage: dict) -> dict:
    """What ``stage`` of ``spec`` spent for ``usage``, as the ledger records it::

        {"lines": [...] | None, "usd": float | None, "billed_hardware": key | None,
         "billing_note": str | None, "parts_usd": {name: usd}}

    ``usage``: ``seconds`` of work; ``prompt_tokens``/``completion_tokens`` (the teacher's new generations);
    ``device`` ("cuda"/"cpu") the work ran on (billed at the hardware used: ``billed_hardware``), or
    ``hardware`` (a catalog key, as is); ``parts``: {name: seconds} shares of ``seconds`` priced alike.
    The teacher stages (``teacher_generations``, ``teacher_scoring``) are priced by the teacher's one price
    field (``teacher_lines``); ``lines`` is None when it is unpriced (unknown, never $0). ``on_policy_scoring``
    (the teacher's prefills of the student's samples in on-policy training, billed with ``student_adapter``) is
    priced per round from ``rounds`` (``_on_policy_bill``, ``on_policy_scoring_lines``)."""
    if stage not in STAGE_KIND:
        raise ValueError(f"no pricing for stage {stage!r}; stages that spend: {sorted(STAGE_KIND)}")
    unknown = set(usage) - set(USAGE_FIELDS)
    if unknown:
        raise ValueError(f"usage of {stage}: unknown field(s) {sorted(unknown)}; expected {list(USAGE_FIELDS)}")
    kind, seconds = STAGE_KIND[stage], float(usage.get("seconds", 0.0))
    if stage == ON_POLICY_SCORING:
        return _on_policy_bill(spec, catalog, usage)
    if stage in TEACHER_STAGES:
        lines = teacher_lines(
            spec,
            catalog,
            seconds,
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
            kind=kind,
        )
        return {
            "lines": lines,
            "usd": None if lines is None else total(lines),
            "billed_hardware": None,
            "billing_note": None,
            "parts_usd": {},
        }
    tr, tier = spec.training, spec.cost.pricing_tier
    note = None
    if usage.get("hardware") is not None:
        billed = usage["hardware"]
    elif usage.get("device") is not None:
        billed, note = billed_hardware(
            spec, catalog, usage["device"], what="training" if kind == "training" else "local evaluation"
        )
    else:
        billed = tr.hardware
    entry = catalog.get(billed)
    shape = {"hosts": tr.nodes, "devices": tr.world_size} if kind == "training" else {}
    lines = [compute_line(kind, entry, seconds, tier=tier, **shape)]
    parts = {
        name: compute_line(kind, entry, s, tier=tier, **shape)["usd"] for name, s in (usage.get("parts") or {}).items()
    }
    return {"lines": lines, "usd": total(lines), "billed_hardware": billed, "billing_note": note, "parts_usd": parts}
