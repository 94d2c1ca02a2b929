"""The promotion gate: rules over a suite's paired candidate and base results -> GO / NO-GO /
INCONCLUSIVE, every rule with its numbers. Pure Python (+ numpy/scipy through ``stats``).

How a suite is judged:

1. Items a model failed on the serving side (timeouts, crashes: ``error`` set) are errors, not
   wrong answers: they are left out of every score. The *paired* set is the items both models
   answered; candidate − base is computed on it.
2. Preconditions: ``max_error_rate`` (each model) and ``min_items`` (paired items). When a
   blocking precondition is not met the suite is INCONCLUSIVE whatever the other rules say: a
   measurement with too many holes decides nothing.
3. Rules: ``min_score`` and the rate/latency limits are judged on the observed value (PASS or
   BREACH); ``max_regression_vs_base`` and ``max_category_regression`` on the paired interval
   of candidate − base: BREACH when the whole interval is below −allowed drop, PASS when the
   whole interval is at or above it, INSUFFICIENT_EVIDENCE when it straddles.
4. Verdict: any blocking BREACH -> NO-GO; else any blocking INSUFFICIENT_EVIDENCE ->
   INCONCLUSIVE; else GO. Advisory rules (and advisory suites) are reported, never blocking.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from statistics import fmean

import numpy as np

from campaigns.spec import GateSpec
from evaluation import stats

GO, NO_GO, INCONCLUSIVE = "GO", "NO-GO", "INCONCLUSIVE"
PASS, BREACH, NOT_ENOUGH = "PASS", "BREACH", "INSUFFICIENT_EVIDENCE"
FAIL = BREACH  # the first version's name
BLOCKING, ADVISORY = "blocking", "advisory"
PRECONDITIONS = ("max_error_rate", "min_items")
ALL = "(all)"
_SPEC_DEFAULTS = GateSpec()  # one place for the gate's defaults: the campaign spec


@dataclass(frozen=True)
class GatePolicy:
    """The rules of one suite: ``campaigns.spec.GateSpec``'s fields, with its defaults (documented there);
    ``None`` switches a rule off."""

    min_score: float | None = _SPEC_DEFAULTS.min_score
    max_regression_vs_base: float | None = _SPEC_DEFAULTS.max_regression_vs_base
    max_category_regression: float | None = _SPEC_DEFAULTS.max_category_regression
    min_category_items: int = _SPEC_DEFAULTS.min_category_items
    max_empty_output_rate: float | None = _SPEC_DEFAULTS.max_empty_output_rate
    max_p95_latency_s: float | None = _SPEC_DEFAULTS.max_p95_latency_s
    max_avg_latency_s: float | None = _SPEC_DEFAULTS.max_avg_latency_s
    min_items: int = _SPEC_DEFAULTS.min_items
    max_error_rate: float = _SPEC_DEFAULTS.max_error_rate
    advisory: tuple[str, ...] = tuple(_SPEC_DEFAULTS.advisory)

    @classmethod
    def from_mapping(cls, m: dict) -> GatePolicy:
        return cls(**{**m, "advisory": tuple(m.get("advisory", ()))})


@dataclass(frozen=True)
class StatsPolicy:
    method: str = stats.PAIRED_BOOTSTRAP
    confidence: float = 0.95
    resamples: int = 10_000
    seed: int = 0

    def describe(self) -> str:
        pct = f"{self.confidence:.0%}"
        if self.method == stats.PAIRED_T:
            how = f"paired t intervals ({pct}) on per-item differences"
        else:
            how = f"paired bootstrap {pct} intervals (percentile, {self.resamples:,} resamples, seed {self.seed})"
        return (
            f"candidate − base: {how}; scores: Wilson {pct} intervals for 0/1 scores, "
            f"{'t' if self.method == stats.PAIRED_T else 'bootstrap'} otherwise; "
            f"McNemar: exact binomial test on discordant items"
        )


@dataclass(frozen=True)
class ItemResult:
    item_id: str
    category: str
    output: str
    score: float | None  # None when the item errored
    latency_s: float
    error: str | None = None
    prompt: str = ""
    reference: str = ""


@dataclass
class ModelSummary:
    items: int
    answered: int
    errors: int
    error_rate: float
    score: float | None  # mean over answered items
    empty_rate: float
    p95_latency_s: float | None
    avg_latency_s: float | None


@dataclass
class Comparison:
    """Base and candidate on the same (paired) items of a suite or one of its categories."""

    category: str
    n: int
    base: stats.Interval
    candidate: stats.Interval
    delta: stats.Interval
    wins: int
    losses: int
    ties: int
    mcnemar_p: float | None  # binary scores only

    def as_dict(self) -> dict:
        d = asdict(self)
        d["base"], d["candidate"], d["delta"] = self.base.as_dict(), self.candidate.as_dict(), self.delta.as_dict()
        return d


@dataclass
class RuleResult:
    rule: str
    status: str
    value: float | None
    threshold: float | None
    detail: str
    tier: str = BLOCKING

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GateReport:
    """One suite's verdict and everything it was decided on."""

    suite: str
    verdict: str
    candidate: ModelSummary
    base: ModelSummary
    overall: Comparison
    categories: list[Comparison] = field(default_factory=list)
    rules: list[RuleResult] = field(default_factory=list)
    tier: str = BLOCKING
    binary: bool = True

    @property
    def reasons(self) -> list[str]:
        return [
            f"{r.rule}: {r.status} — {r.detail}" + (" (advisory)" if r.tier == ADVISORY else "")
            for r in self.rules
            if r.status != PASS
        ]

    def as_dict(self) -> dict:
        return {
            "suite": self.suite,
            "verdict": self.verdict,
            "tier": self.tier,
            "binary": self.binary,
            "candidate": asdict(self.candidate),
            "base": asdict(self.base),
            "overall": self.overall.as_dict(),
            "categories": [c.as_dict() for c in self.categories],
            "rules": [r.as_dict() for r in self.rules],
        }


def summarize(results: list[ItemResult]) -> ModelSummary:
    answered = [r for r in results if r.error is None]
    scored = [r.score for r in answered if r.score is not None]
    lat = [r.latency_s for r in answered]
    n = len(results)
    return ModelSummary(
        items=n,
        answered=len(answered),
        errors=n - len(answered),
        error_rate=(n - len(answered)) / n if n else 0.0,
        score=fmean(scored) if scored else None,
        empty_rate=(sum(1 for r in answered if not r.output.strip()) / len(answered)) if answered else 0.0,
        p95_latency_s=float(np.percentile(lat, 95)) if lat else None,
        avg_latency_s=fmean(lat) if lat else None,
    )


def pair(candidate: list[ItemResult], base: list[ItemResult]) -> list[tuple[ItemResult, ItemResult]]:
    """Items both models answered (no error, scored), in the candidate's order."""
    by_id = {r.item_id: r for r in base}
    missing = [r.item_id for r in candidate if r.item_id not in by_id]
    if missing or len(by_id) != len(candidate):
        raise ValueError(
            f"candidate and base must answer the same items; {len(missing)} candidate items have no "
            f"base result (e.g. {missing[:3]}), {len(by_id)} base vs {len(candidate)} candidate items"
        )
    out = []
    for c in candidate:
        b = by_id[c.item_id]
        if c.error is None and b.error is None and c.score is not None and b.score is not None:
            out.append((c, b))
    return out


def compare(pairs: list[tuple[ItemResult, ItemResult]], category: str, binary: bool, sp: StatsPolicy) -> Comparison:
    cs = [c.score for c, _ in pairs]
    bs = [b.score for _, b in pairs]
    kw = {"confidence": sp.confidence, "method": sp.method, "resamples": sp.resamples, "seed": sp.seed}
    wlt = stats.win_loss_tie(cs, bs)
    return Comparison(
        category=category,
        n=len(pairs),
        base=stats.score_ci(bs, **kw),
        candidate=stats.score_ci(cs, **kw),
        delta=stats.paired_difference(cs, bs, **kw),
        wins=wlt.wins,
        losses=wlt.losses,
        ties=wlt.ties,
        mcnemar_p=stats.mcnemar_exact(wlt.wins, wlt.losses) if binary else None,
    )


def interval_rule(delta: stats.Interval, allowed_drop: float) -> str:
    """BREACH when the whole interval is beyond the allowed drop, PASS when within, else not enough evidence."""
    if not delta.defined:
        return NOT_ENOUGH
    eps = 1e-12  # a bound exactly at the allowed drop (up to float rounding) is within it
    if delta.hi < -allowed_drop - eps:
        return BREACH
    if delta.lo >= -allowed_drop - eps:
        return PASS
    return NOT_ENOUGH


def _pts(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:+.1f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


def _ci(iv: stats.Interval) -> str:
    return f"[{_pts(iv.lo)}, {_pts(iv.hi)}] pts" if iv.defined else "[undefined]"


def decide(
    suite: str,
    candidate: list[ItemResult],
    base: list[ItemResult],
    policy: GatePolicy,
    sp: StatsPolicy = StatsPolicy(),
    binary: bool | None = None,
    tier: str = BLOCKING,
) -> GateReport:
    """Judge one suite. ``binary`` (0/1 scores) is detected from the scores when not given."""
    c_sum, b_sum = summarize(candidate), summarize(base)
    pairs = pair(candidate, base)
    if binary is None:
        binary = stats.is_binary([r.score for r in candidate + base if r.score is not None])
    overall = compare(pairs, ALL, binary, sp)
    by_cat: dict[str, list] = defaultdict(list)
    for p in pairs:
        by_cat[p[0].category].append(p)
    categories = [compare(v, k, binary, sp) for k, v in sorted(by_cat.items())]
    single_category = categories[0].category if len(categories) == 1 else None
    if single_category is not None:  # one category: the overall row says it all
        categories = []

    def tier_of(rule: str) -> str:
        return ADVISORY if tier == ADVISORY or rule in policy.advisory else BLOCKING

    rules: list[RuleResult] = []

    def add(rule: str, status: str, value: float | None, threshold: float | None, detail: str) -> None:
        rules.append(RuleResult(rule, status, value, threshold, detail, tier_of(rule)))

    err = max(c_sum.error_rate, b_sum.error_rate)
    add(
        "max_error_rate",
        PASS if err <= policy.max_error_rate else NOT_ENOUGH,
        err,
        policy.max_error_rate,
        f"serving errors (timeouts, crashes; not scored): candidate {c_sum.errors}/{c_sum.items}, "
        f"base {b_sum.errors}/{b_sum.items}; allowed {policy.max_error_rate:.1%} per model",
    )
    add(
        "min_items",
        PASS if overall.n >= policy.min_items else NOT_ENOUGH,
        float(overall.n),
        float(policy.min_items),
        f"{overall.n} paired scored items, need at least {policy.min_items}",
    )
    if policy.min_score is not None:
        own = [r.score for r in candidate if r.error is None and r.score is not None]
        iv = stats.score_ci(own, sp.confidence, sp.method, sp.resamples, sp.seed)
        s = c_sum.score
        ok = s is not None and s >= policy.min_score
        add(
            "min_score",
            PASS if ok else (BREACH if s is not None else NOT_ENOUGH),
            s,
            policy.min_score,
            f"candidate {_pct(s)} [{_pct(iv.lo)}, {_pct(iv.hi)}] on {len(own)} answered items "
            f"{'≥' if ok else '<'} floor {policy.min_score:.1%}",
        )
    if policy.max_regression_vs_base is not None:
        d = overall.delta
        status = interval_rule(d, policy.max_regression_vs_base)
        add(
            "max_regression_vs_base",
            status,
            d.estimate if overall.n else None,
            -policy.max_regression_vs_base,
            f"candidate − base {_pts(d.estimate)} pts {_ci(d)}, allowed drop "
            f"{policy.max_regression_vs_base * 100:.1f} pts",
        )
    if policy.max_category_regression is not None:
        allowed = policy.max_category_regression
        judged = [c for c in categories if c.n >= policy.min_category_items]
        small = [c.category for c in categories if c.n < policy.min_category_items]
        per = {c.category: interval_rule(c.delta, allowed) for c in judged}
        statuses = set(per.values())
        status = BREACH if BREACH in statuses else NOT_ENOUGH if NOT_ENOUGH in statuses else PASS
        worst = min(judged, key=lambda c: c.delta.hi if c.delta.defined else math.inf, default=None)
        parts = [
            f"{c.category} {_pts(c.delta.estimate)} {_ci(c.delta)} {per[c.category]}"
            for c in judged
            if per[c.category] != PASS
        ] or ["every judged category within the allowed drop"]
        if single_category is not None:
            parts = [f"one category ({single_category}): judged as the whole suite by max_regression_vs_base"]
        elif not judged:
            parts = ["no category has enough items to judge"]
        if small:
            parts.append(f"not judged (< {policy.min_category_items} items): {', '.join(small)}")
        add(
            "max_category_regression",
            status,
            worst.delta.estimate if worst else None,
            -allowed,
            f"allowed drop {allowed * 100:.1f} pts per category; " + "; ".join(parts),
        )
    if policy.max_empty_output_rate is not None:
        e = c_sum.empty_rate
        add(
            "max_empty_output_rate",
            PASS if e <= policy.max_empty_output_rate else BREACH,
            e,
            policy.max_empty_output_rate,
            f"empty candidate outputs {_pct(e)} (max {_pct(policy.max_empty_output_rate)})",
        )
    for rule, value, name in (
        ("max_p95_latency_s", c_sum.p95_latency_s, "p95"),
        ("max_avg_latency_s", c_sum.avg_latency_s, "mean"),
    ):
        limit = getattr(policy, rule)
        if limit is None:
            continue
        if value is None:
            add(rule, NOT_ENOUGH, None, limit, "no answered items to time")
        else:
            add(
                rule,
                PASS if value <= limit else BREACH,
                value,
                limit,
                f"candidate {name} latency {value:.2f} s (max {limit:.1f} s)",
            )
    # an advisory suite still gets the verdict its rules give; `combine` leaves it out
    verdict = suite_verdict(
        [r for r in rules if r.rule not in policy.advisory] if tier == ADVISORY else rules, every_tier=tier == ADVISORY
    )
    return GateReport(suite, verdict, c_sum, b_sum, overall, categories, rules, tier, binary)


def suite_verdict(rules: list[RuleResult], every_tier: bool = False) -> str:
    blocking = [r for r in rules if every_tier or r.tier == BLOCKING]
    if any(r.status != PASS for r in blocking if r.rule in PRECONDITIONS):
        return INCONCLUSIVE
    statuses = {r.status for r in blocking}
    return NO_GO if BREACH in statuses else INCONCLUSIVE if NOT_ENOUGH in statuses else GO


def combine(reports: list[GateReport]) -> str:
    """The campaign's verdict over its blocking suites (an advisory suite never blocks)."""
    verdicts = {r.verdict for r in reports if r.tier == BLOCKING}
    return NO_GO if NO_GO in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else GO
