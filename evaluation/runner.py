"""Paired evaluation: every model answers every suite's items with the same settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from evaluation.gate import GatePolicy, GateReport, ItemResult, decide, summarize
from evaluation.suite import Generate, run_suite


@dataclass
class SuiteRun:
    name: str
    items: list[dict]
    scorer: str
    max_new_tokens: int


@dataclass
class PairedResult:
    reports: list[GateReport]
    rows: list[dict]
    scores: dict[str, dict[str, float | None]] = field(default_factory=dict)  # model -> suite -> score


def evaluate_paired(suites: list[SuiteRun], models: dict[str, Callable[[], Generate]], policy: GatePolicy,
                    log: Callable[[str], None] = print) -> PairedResult:
    """``models`` maps a role ("candidate", "base", optionally "teacher") to a factory of its
    generate function; each model is loaded once and answers every suite."""
    if "candidate" not in models or "base" not in models:
        raise ValueError("paired evaluation needs a 'candidate' and a 'base' model")
    results: dict[str, dict[str, list[ItemResult]]] = {}
    rows: list[dict] = []
    for role, factory in models.items():
        generate = factory()
        results[role] = {}
        for s in suites:
            res, r = run_suite(s.name, role, s.items, generate, s.scorer, s.max_new_tokens)
            results[role][s.name] = res
            rows += r
            log(f"{role} on {s.name}: score {summarize(res).score}")
    reports = [decide(s.name, results["candidate"][s.name], results["base"][s.name], policy) for s in suites]
    scores = {role: {s: summarize(v).score for s, v in by_suite.items()} for role, by_suite in results.items()}
    return PairedResult(reports, rows, scores)
