"""The gate report: a JSON document (gate.json) and the markdown a reviewer reads in the UI.

One table per campaign: per suite and category, base, candidate and candidate − base with its
interval, win/loss/tie and McNemar; then every rule's result with its numbers; then the ten most
informative disagreements (losses before wins, spread over suites and categories).
"""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import zip_longest

from evaluation.gate import (
    ADVISORY,
    ALL,
    BREACH,
    NOT_ENOUGH,
    PASS,
    Comparison,
    GateReport,
    ItemResult,
    StatsPolicy,
    combine,
    pair,
)

_MARK = {PASS: "PASS", BREACH: "**BREACH**", NOT_ENOUGH: "**INSUFFICIENT_EVIDENCE**"}
_VERDICT_MARK = {"GO": "GO", "NO-GO": "NO-GO", "INCONCLUSIVE": "INCONCLUSIVE"}


def _cell(text: str | None, width: int = 48) -> str:
    if text is None:
        return "—"
    if not text.strip():
        return "∅ *(empty)*"
    t = " ".join(text.split())
    t = t if len(t) <= width else t[: width - 1] + "…"
    return "`" + t.replace("`", "'").replace("|", "\\|") + "`"


def _pct(x: float | None) -> str:
    return "—" if x is None or math.isnan(x) else f"{x:.1%}"


def _pts(x: float | None) -> str:
    return "—" if x is None or math.isnan(x) else f"{x * 100:+.1f}"


def _score(iv) -> str:
    if iv.estimate is None or math.isnan(iv.estimate):
        return "—"
    ci = f" [{iv.lo * 100:.1f}, {iv.hi * 100:.1f}]" if iv.defined else ""
    return f"{iv.estimate:.1%}{ci}"


def _delta(iv) -> str:
    if math.isnan(iv.estimate):
        return "—"
    ci = f" [{_pts(iv.lo)}, {_pts(iv.hi)}]" if iv.defined else " [undefined]"
    return f"**{_pts(iv.estimate)}**{ci}"


def _p(p: float | None) -> str:
    if p is None:
        return "—"
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def rule_value(rule: str, x: float | None) -> str:
    """A gate rule's measured value for people: a share in percent, a change in points of percent, seconds, items."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if rule == "min_items":
        return f"{x:.0f}"
    if rule.endswith("latency_s"):
        return f"{x:.2f} s"
    if rule in ("max_regression_vs_base", "max_category_regression"):
        return f"{_pts(x)} pts"
    return f"{x:.1%}"


def rule_threshold(rule: str, x: float | None) -> str:
    """A gate rule's threshold for people, with the side a value must be on (in the units of :func:`rule_value`)."""
    if x is None:
        return "—"
    if rule == "min_items" or rule == "min_score":
        return "≥ " + rule_value(rule, x)
    if rule in ("max_regression_vs_base", "max_category_regression"):
        return f"CI low ≥ {_pts(x)} pts"
    return "≤ " + rule_value(rule, x)


def disagreements(
    items: dict[str, tuple[list[ItemResult], list[ItemResult]]], limit: int = 10
) -> tuple[list[dict], int]:
    """The ``limit`` most informative disagreements and how many there are in all.

    Losses (candidate worse than base) come before wins, larger score gaps first, and the picks
    rotate over (suite, category) so one category cannot fill the list."""
    groups: dict[tuple[int, str, str], list[dict]] = defaultdict(list)
    total = 0
    for suite, (cand, base) in items.items():
        for c, b in pair(cand, base):
            if c.score == b.score:
                continue
            total += 1
            d = c.score - b.score
            groups[(0 if d < 0 else 1, suite, c.category)].append(
                {
                    "suite": suite,
                    "category": c.category,
                    "item_id": c.item_id,
                    "prompt": c.prompt,
                    "reference": c.reference,
                    "base": b.output,
                    "candidate": c.output,
                    "base_score": b.score,
                    "candidate_score": c.score,
                    "delta": d,
                    "kind": "loss" if d < 0 else "win",
                }
            )
    picked: list[dict] = []
    for kind in (0, 1):
        lists = [
            sorted(v, key=lambda r: (-abs(r["delta"]), r["item_id"])) for k, v in sorted(groups.items()) if k[0] == kind
        ]
        for row in zip_longest(*lists):
            picked += [r for r in row if r is not None]
    return picked[:limit], total


def _by_category(results: list[ItemResult]) -> dict[str, float | None]:
    acc: dict[str, list[float]] = defaultdict(list)
    for r in results:
        if r.error is None and r.score is not None:
            acc[ALL].append(r.score)
            acc[r.category].append(r.score)
    return {k: sum(v) / len(v) for k, v in acc.items()}


def teacher_reference(
    reports: list[GateReport], teacher_scores: dict[str, dict[str, float | None]], teacher_of: dict[str, str] | None
) -> dict[str, list[dict]]:
    """Per suite, per category (``all`` first): the teacher that answers the category (``teacher_of``: category ->
    its name, several teachers; None: the one teacher), its score, the candidate's, and student ÷ teacher (None when
    the teacher was not scored or scored 0)."""
    out: dict[str, list[dict]] = {}
    for r in reports:
        by_cat = teacher_scores.get(r.suite)
        if by_cat is None:
            continue
        rows = []
        for c in [r.overall, *r.categories]:
            t, cand = by_cat.get(c.category), c.candidate.estimate
            cand = None if cand is None or math.isnan(cand) else cand
            name = None if c.category == ALL or teacher_of is None else teacher_of.get(c.category)
            rows.append(
                {
                    "category": c.category,
                    "teacher": name if teacher_of is not None else "teacher",
                    "teacher_score": t,
                    "candidate_score": cand,
                    "student_teacher_ratio": cand / t if cand is not None and t else None,
                }
            )
        out[r.suite] = rows
    return out


def build_report(
    reports: list[GateReport],
    items: dict[str, tuple[list[ItemResult], list[ItemResult]]],
    sp: StatsPolicy,
    candidate_key: str,
    teacher: dict[str, list[ItemResult]] | None = None,
    review: str | None = None,
    teacher_of: dict[str, str] | None = None,
) -> dict:
    """The gate document: verdict, reasons, per-suite numbers and the markdown report. ``teacher``
    (suite -> item results) adds the teacher's scores as the ceiling column, and ``teacher_reference`` (student ÷
    teacher per suite and category); ``teacher_of`` (category -> teacher name, several teachers): the teacher each
    category's reference is, named in the column."""
    verdict = combine(reports)
    teacher_scores = {suite: _by_category(res) for suite, res in (teacher or {}).items()}
    shown, total = disagreements(items)
    reasons = [f"{r.suite}: {why}" for r in reports for why in r.reasons]
    doc = {
        "verdict": verdict,
        "candidate_key": candidate_key,
        "method": sp.describe(),
        "statistics": {"interval": sp.method, "confidence": sp.confidence, "resamples": sp.resamples, "seed": sp.seed},
        "suites": [r.as_dict() for r in reports],
        "reasons": reasons,
        "disagreements": shown,
        "disagreements_total": total,
    }
    if teacher_scores:
        doc["teacher_reference"] = teacher_reference(reports, teacher_scores, teacher_of)
    doc["markdown"] = markdown(reports, sp, candidate_key, shown, total, teacher_scores, review, teacher_of)
    return doc


def markdown(
    reports: list[GateReport],
    sp: StatsPolicy,
    candidate_key: str,
    shown: list[dict],
    total: int,
    teacher_scores: dict[str, dict[str, float | None]] | None = None,
    review: str | None = None,
    teacher_of: dict[str, str] | None = None,
) -> str:
    verdict = combine(reports)
    sizes = ", ".join(f"{r.suite} {r.overall.n}" + (" (advisory)" if r.tier == ADVISORY else "") for r in reports)
    lines = [
        f"## Gate: **{_VERDICT_MARK.get(verdict, verdict)}**",
        "",
        f"Candidate `{candidate_key}` against its base on the same paired items ({sizes}). Intervals: {sp.describe()}.",
        "",
    ]
    why = [
        f"- **{r.suite}** ({r.verdict}): {reason}"
        for r in reports
        if r.verdict != "GO"
        for reason, rule in zip(r.reasons, [x for x in r.rules if x.status != PASS], strict=True)
        if rule.tier != ADVISORY
    ]
    if why:
        lines += ["Why:", *why, ""]
    if review:
        lines += [review, ""]
    teacher = teacher_scores or {}
    head = "| suite | category | n | base | candidate | Δ cand − base, pts [CI] | W / L / T | McNemar p |"
    sep = "|---|---|---:|---:|---:|---:|---:|---:|"
    if teacher:
        head, sep = head + " teacher |", sep + "---:|"
    lines += [head, sep]

    def row(r: GateReport, c: Comparison, label: str) -> str:
        line = (
            f"| {r.suite} | {label} | {c.n} | {_score(c.base)} | {_score(c.candidate)} | {_delta(c.delta)} | "
            f"{c.wins} / {c.losses} / {c.ties} | {_p(c.mcnemar_p)} |"
        )
        if teacher:
            who = (teacher_of or {}).get(c.category)  # several teachers: the one that answers the category
            line += f" {_pct(teacher.get(r.suite, {}).get(c.category))}{f' ({who})' if who else ''} |"
        return line

    for r in reports:
        lines.append(row(r, r.overall, "**all**"))
        lines += [row(r, c, c.category) for c in r.categories]
    lines += [
        "",
        "| suite | verdict | rule | tier | result | value | threshold | detail |",
        "|---|---|---|---|---|---:|---:|---|",
    ]
    for r in reports:
        v = f"**{_VERDICT_MARK.get(r.verdict, r.verdict)}**" + (" (advisory suite)" if r.tier == ADVISORY else "")
        rules = r.rules
        if r.tier == ADVISORY and all(x.status == PASS for x in rules):  # nothing to read: one line
            lines.append(
                f"| {r.suite} | {v} | {', '.join(x.rule for x in rules)} | advisory | PASS | | | "
                "every rule passes (numbers in gate.json) |"
            )
            continue
        for i, rule in enumerate(rules):
            lines.append(
                f"| {r.suite if i == 0 else ''} | {v if i == 0 else ''} | {rule.rule} | {rule.tier} | "
                f"{_MARK.get(rule.status, rule.status)} | {rule_value(rule.rule, rule.value)} | "
                f"{rule_threshold(rule.rule, rule.threshold)} | {rule.detail.replace('|', '/')} |"
            )
    lines += ["", f"### Most informative disagreements ({len(shown)} of {total})", ""]
    if not shown:
        lines.append("Candidate and base agree on every paired item.")
    else:
        lines += [
            "| suite | category | item | prompt | reference | base | candidate | |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for d in shown:
            tag = "candidate loses" if d["kind"] == "loss" else "candidate wins"
            lines.append(
                f"| {d['suite']} | {d['category']} | {d['item_id']} | {_cell(d['prompt'])} | "
                f"{_cell(d['reference'])} | {_cell(d['base'])} | {_cell(d['candidate'])} | {tag} |"
            )
    return "\n".join(lines)


__all__ = ["ALL", "build_report", "disagreements", "markdown", "rule_threshold", "rule_value"]
