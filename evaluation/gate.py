"""The promotion gate: rules over a suite's candidate and base results -> GO / NO-GO / INCONCLUSIVE.

Each rule yields a :class:`RuleResult` with its numbers, so a reviewer sees why. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import fmean

GO, NO_GO, INCONCLUSIVE = "GO", "NO-GO", "INCONCLUSIVE"
PASS, FAIL, NOT_ENOUGH = "PASS", "FAIL", "INSUFFICIENT_EVIDENCE"


@dataclass(frozen=True)
class GatePolicy:
    min_score: float = 0.8
    max_regression_vs_base: float = 0.03
    max_empty_output_rate: float = 0.0
    max_avg_latency_s: float = 30.0
    min_items: int = 20
    max_error_rate: float = 0.05


@dataclass(frozen=True)
class ItemResult:
    item_id: str
    category: str
    output: str
    score: float | None  # None when the item errored
    latency_s: float
    error: str | None = None


@dataclass
class RuleResult:
    rule: str
    status: str
    value: float | None
    threshold: float | None
    detail: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SuiteSummary:
    items: int
    scored: int
    errors: int
    score: float | None
    empty_rate: float
    avg_latency_s: float


@dataclass
class GateReport:
    suite: str
    verdict: str
    candidate: SuiteSummary
    base: SuiteSummary
    rules: list[RuleResult] = field(default_factory=list)

    @property
    def reasons(self) -> list[str]:
        return [r.detail for r in self.rules if r.status != PASS]

    def as_dict(self) -> dict:
        return {
            "suite": self.suite,
            "verdict": self.verdict,
            "candidate": asdict(self.candidate),
            "base": asdict(self.base),
            "rules": [r.as_dict() for r in self.rules],
        }


def summarize(results: list[ItemResult]) -> SuiteSummary:
    scored = [r for r in results if r.error is None and r.score is not None]
    ok_outputs = [r for r in results if r.error is None]
    return SuiteSummary(
        items=len(results),
        scored=len(scored),
        errors=len(results) - len(ok_outputs),
        score=fmean(r.score for r in scored) if scored else None,  # type: ignore[misc]
        empty_rate=(sum(1 for r in ok_outputs if not r.output.strip()) / len(ok_outputs)) if ok_outputs else 0.0,
        avg_latency_s=fmean(r.latency_s for r in ok_outputs) if ok_outputs else 0.0,
    )


def decide(suite: str, candidate: list[ItemResult], base: list[ItemResult], policy: GatePolicy) -> GateReport:
    c, b = summarize(candidate), summarize(base)
    rules: list[RuleResult] = []
    err_rate = c.errors / c.items if c.items else 1.0
    rules.append(
        RuleResult("max_error_rate", PASS if err_rate <= policy.max_error_rate else NOT_ENOUGH, err_rate,
                   policy.max_error_rate, f"{c.errors} of {c.items} candidate items errored (serving side, not scored)")
    )
    rules.append(
        RuleResult("min_items", PASS if c.scored >= policy.min_items else NOT_ENOUGH, float(c.scored),
                   float(policy.min_items), f"{c.scored} scored items, need at least {policy.min_items}")
    )
    if c.score is not None:
        rules.append(
            RuleResult("min_score", PASS if c.score >= policy.min_score else FAIL, c.score, policy.min_score,
                       f"candidate score {c.score:.3f} {'≥' if c.score >= policy.min_score else '<'} floor {policy.min_score:.3f}")
        )
    if c.score is not None and b.score is not None:
        delta = c.score - b.score
        ok = delta >= -policy.max_regression_vs_base
        rules.append(
            RuleResult("max_regression_vs_base", PASS if ok else FAIL, delta, -policy.max_regression_vs_base,
                       f"candidate − base = {delta:+.3f} (allowed drop {policy.max_regression_vs_base:.3f})")
        )
    rules.append(
        RuleResult("max_empty_output_rate", PASS if c.empty_rate <= policy.max_empty_output_rate else FAIL, c.empty_rate,
                   policy.max_empty_output_rate, f"empty outputs {c.empty_rate:.3f} (max {policy.max_empty_output_rate:.3f})")
    )
    rules.append(
        RuleResult("max_avg_latency_s", PASS if c.avg_latency_s <= policy.max_avg_latency_s else FAIL, c.avg_latency_s,
                   policy.max_avg_latency_s, f"average latency {c.avg_latency_s:.3f}s (max {policy.max_avg_latency_s:.1f}s)")
    )
    statuses = {r.status for r in rules}
    verdict = INCONCLUSIVE if NOT_ENOUGH in statuses else NO_GO if FAIL in statuses else GO
    return GateReport(suite, verdict, c, b, rules)


def combine(reports: list[GateReport]) -> str:
    verdicts = {r.verdict for r in reports}
    return NO_GO if NO_GO in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else GO


def markdown_report(reports: list[GateReport], teacher_scores: dict[str, float | None] | None = None) -> str:
    lines = ["| suite | teacher | base | candidate | delta | verdict |", "|---|---:|---:|---:|---:|---|"]
    for r in reports:
        t = (teacher_scores or {}).get(r.suite)
        fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
        delta = None if r.candidate.score is None or r.base.score is None else r.candidate.score - r.base.score
        lines.append(f"| {r.suite} | {fmt(t)} | {fmt(r.base.score)} | {fmt(r.candidate.score)} | "
                     f"{'—' if delta is None else f'{delta:+.3f}'} | **{r.verdict}** |")
    lines += ["", "| suite | rule | status | detail |", "|---|---|---|---|"]
    for r in reports:
        for rule in r.rules:
            lines.append(f"| {r.suite} | {rule.rule} | {rule.status} | {rule.detail} |")
    return "\n".join(lines)
