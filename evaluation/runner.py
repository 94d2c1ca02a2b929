"""Paired evaluation: every model answers every suite's items with the same settings, then the
gate judges candidate against base from the stored item rows.

Answering (slow: models generate) and judging (fast: statistics over the rows) are separate, so
a changed gate policy re-judges stored answers instead of generating them again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from evaluation.gate import BLOCKING, GatePolicy, GateReport, ItemResult, StatsPolicy, decide, summarize
from evaluation.scorers import Scorer
from evaluation.suite import Generate, run_suite

CANDIDATE, BASE, TEACHER = "candidate", "base", "teacher"


@dataclass
class SuiteRun:
    """A suite as every model answers it."""

    name: str
    items: list[dict]
    scorer: Scorer
    max_new_tokens: int


@dataclass
class SuiteGate:
    """A suite as the gate judges it."""

    name: str
    policy: GatePolicy
    binary: bool | None  # None: detected from the scores (lm_eval metrics)
    tier: str = BLOCKING


def answer_suites(
    suites: list[SuiteRun],
    models: dict[str, Callable[[], Generate]],
    log: Callable[[str], None] = print,
    progress: Callable[[int], None] | None = None,
) -> list[dict]:
    """Item rows of every model on every suite. ``models`` maps a role ("candidate", "base",
    optionally "teacher") to a factory of its generate function; each model is loaded once.
    ``progress(n)`` is called after each model's suite with its item count (a budget watch may
    raise there to stop the stage)."""
    if CANDIDATE not in models or BASE not in models:
        raise ValueError("paired evaluation needs a 'candidate' and a 'base' model")
    rows: list[dict] = []
    for role, factory in models.items():
        generate = _once_per_prompt(factory())
        for s in suites:
            res, r = run_suite(s.name, role, s.items, generate, s.scorer, s.max_new_tokens)
            rows += r
            sm = summarize(res)
            log(
                f"{role} on {s.name}: score {sm.score if sm.score is None else round(sm.score, 4)}, "
                f"{sm.errors} errors of {sm.items}"
            )
            if progress is not None:
                progress(len(r))
    return rows


def _once_per_prompt(generate: Generate) -> Generate:
    """Suites that share prompts and settings (same items, another scorer) reuse one answer."""
    cache: dict[tuple[str, int], object] = {}

    def g(prompts, max_new_tokens):
        todo = [p for p in dict.fromkeys(prompts) if (p, max_new_tokens) not in cache]
        if todo:
            outs = generate(todo, max_new_tokens)
            if len(outs) != len(todo):
                raise RuntimeError(f"the model returned {len(outs)} completions for {len(todo)} prompts")
            cache.update({(p, max_new_tokens): o for p, o in zip(todo, outs, strict=True)})
        return [cache[(p, max_new_tokens)] for p in prompts]

    return g


def judge(
    results: dict[str, dict[str, list[ItemResult]]], suites: list[SuiteGate], sp: StatsPolicy
) -> list[GateReport]:
    """One gate report per suite, candidate against base on the same items."""
    out = []
    for s in suites:
        cand, base = results.get(CANDIDATE, {}).get(s.name), results.get(BASE, {}).get(s.name)
        if cand is None or base is None:
            raise ValueError(f"suite {s.name}: the stored items lack candidate or base results")
        out.append(decide(s.name, cand, base, s.policy, sp, s.binary, s.tier))
    return out


def scores(results: dict[str, dict[str, list[ItemResult]]]) -> dict[str, dict[str, float | None]]:
    """role -> suite -> mean score over answered items."""
    return {
        role: {suite: summarize(items).score for suite, items in by_suite.items()} for role, by_suite in results.items()
    }
