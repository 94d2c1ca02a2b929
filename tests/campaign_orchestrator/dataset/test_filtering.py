"""Filtering teacher generations into the distillation set: every rule drops and is counted."""

from __future__ import annotations

import pytest

from campaign_orchestrator.dataset.filtering import RULES, FilterRules, filter_generations
from evaluation.scorers import get_scorer


def _r(
    i: str,
    completion: str,
    finish: str = "stop",
    error: str | None = None,
    prompt: str | None = None,
    tokens: int | None = None,
) -> dict:
    return {
        "id": i,
        "prompt": prompt or f"encode {i} =",
        "completion": completion,
        "finish_reason": finish,
        "error": error,
        "completion_tokens": tokens if tokens is not None else len(completion),
    }


ROWS = [
    _r("a", " itssg"),  # kept
    _r("b", "", error="prompt exceeds the teacher's context"),  # error
    _r("c", "   "),  # empty
    _r("d", " abcdefghijkl", finish="length"),  # truncated
    _r("e", " x" * 40),  # length (max_chars)
    _r("f", " Not One Word"),  # format
    _r("g", " wrong"),  # scorer (reference differs)
    _r("h", " fine"),  # no reference
    _r("a", " itssg"),  # duplicate of the first (same prompt, same completion)
    _r("i", " okay", tokens=50),  # length (max_completion_tokens)
]
REFS = {"a": "itssg", "b": "x", "c": "x", "d": "x", "e": "x", "f": "x", "g": "right", "i": "okay"}


def test_every_rule_is_counted_once_in_order():
    rules = FilterRules(format_regex="[a-z]+", max_chars=30, scorer="exact_match", max_completion_tokens=20)
    kept, counts = filter_generations(ROWS, rules, REFS, score_fn=get_scorer("exact_match"))
    assert [r["id"] for r in kept] == ["a"]
    assert counts == {
        "error": 1,
        "empty": 1,
        "truncated": 1,
        "length": 2,
        "format": 1,
        "scorer": 1,
        "no_reference": 1,
        "duplicate": 1,
        "kept": 1,
        "input": 10,
    }
    assert set(RULES) <= set(counts)


def test_rules_can_be_switched_off():
    rules = FilterRules(drop_empty=False, drop_truncated=False, dedupe=False, min_chars=0)
    kept, counts = filter_generations(ROWS, rules)
    assert counts["error"] == 1 and counts["kept"] == 9  # errors always go: there is no completion
    assert sum(counts[k] for k in RULES) + counts["kept"] == counts["input"]


def test_scorer_threshold_and_custom_score_function():
    rows = [_r("a", " abc"), _r("b", " abd")]
    refs = {"a": "abc", "b": "abc"}
    share = lambda pred, ref: sum(p == q for p, q in zip(pred.strip(), ref, strict=False)) / len(ref)  # noqa: E731
    kept, counts = filter_generations(rows, FilterRules(scorer="exact_match", min_score=0.5), refs, score_fn=share)
    assert [r["id"] for r in kept] == ["a", "b"] and counts["scorer"] == 0
    kept, counts = filter_generations(
        rows, FilterRules(scorer="exact_match", min_score=1.0), refs, score_fn=get_scorer("exact_match")
    )
    assert [r["id"] for r in kept] == ["a"] and counts["scorer"] == 1
    with pytest.raises(ValueError, match="references"):
        filter_generations(rows, FilterRules(scorer="exact_match"), score_fn=share)
    with pytest.raises(ValueError, match="score function"):
        filter_generations(rows, FilterRules(scorer="exact_match"), refs)
