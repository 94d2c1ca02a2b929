"""The gate on constructed item-level data: PASS, BREACH, INSUFFICIENT_EVIDENCE, errors, tiers."""

import pytest

from campaigns.loader import load_campaign_file
from evaluation.gate import (
    BREACH,
    GO,
    INCONCLUSIVE,
    NO_GO,
    NOT_ENOUGH,
    PASS,
    GatePolicy,
    ItemResult,
    StatsPolicy,
    combine,
    decide,
)
from evaluation.report import build_report, disagreements
from evaluation.stats import PAIRED_T
from tests.support import REPO_ROOT


def items(scores, category="c", errors=(), latency=0.5, prefix="i"):
    return [
        ItemResult(
            f"{prefix}{n}",
            category if isinstance(category, str) else category[n],
            "" if n in errors else f"out{s}",
            None if n in errors else float(s),
            latency,
            "timeout after 60 s" if n in errors else None,
            f"prompt {n}",
            "ref",
        )
        for n, s in enumerate(scores)
    ]


def rule(report, name):
    return next(r for r in report.rules if r.rule == name)


POLICY = GatePolicy(min_score=0.5, max_regression_vs_base=0.03, min_items=20, max_p95_latency_s=10.0)


def test_regression_rule_passes_when_the_whole_interval_is_within_the_allowed_drop():
    base = [1] * 150 + [0] * 50
    cand = [1] * 150 + [1] * 10 + [0] * 40  # 10 wins, no losses
    r = decide("s", items(cand), items(base), POLICY)
    reg = rule(r, "max_regression_vs_base")
    assert reg.status == PASS and r.overall.delta.lo >= -0.03
    assert r.verdict == GO
    assert (r.overall.wins, r.overall.losses, r.overall.ties) == (10, 0, 190)
    assert r.overall.mcnemar_p == pytest.approx(2 * 0.5**10)


def test_regression_rule_breaches_when_the_whole_interval_is_beyond_the_allowed_drop():
    base = [1] * 180 + [0] * 20
    cand = [1] * 120 + [0] * 60 + [0] * 20  # 60 losses
    r = decide("s", items(cand), items(base), POLICY)
    reg = rule(r, "max_regression_vs_base")
    assert reg.status == BREACH and r.overall.delta.hi < -0.03
    assert r.verdict == NO_GO
    assert any("max_regression_vs_base: BREACH" in why for why in r.reasons)


def test_regression_rule_is_insufficient_evidence_when_the_interval_straddles_the_allowed_drop():
    base = [1] * 95 + [0] * 5
    cand = [1] * 91 + [0] * 4 + [0] * 5  # 4 losses in 100: −4 pts, interval about [−8, −1]
    r = decide("s", items(cand), items(base), POLICY)
    reg = rule(r, "max_regression_vs_base")
    assert reg.status == NOT_ENOUGH
    assert r.overall.delta.lo < -0.03 < r.overall.delta.hi
    assert r.verdict == INCONCLUSIVE
    # the same data under paired t gives the same kind of answer, and the method is stated
    t = decide("s", items(cand), items(base), POLICY, StatsPolicy(method=PAIRED_T))
    assert rule(t, "max_regression_vs_base").status == NOT_ENOUGH and t.overall.delta.method == PAIRED_T


def test_serving_errors_make_a_suite_inconclusive_not_no_go():
    base = [1] * 100
    cand = [1] * 70 + [0] * 30
    errs = set(range(70, 100))  # the 30 "wrong" items are serving errors (timeouts)
    r = decide("s", items(cand, errors=errs), items(base), POLICY)
    assert (r.candidate.errors, r.candidate.answered, r.candidate.score) == (
        30,
        70,
        1.0,
    )  # errors are not wrong answers
    assert r.overall.n == 70
    assert rule(r, "max_error_rate").status == NOT_ENOUGH
    assert r.verdict == INCONCLUSIVE
    # even with a rule breached on the answered items, too many errors decide nothing
    bad = decide("s", items([0] * 70 + [0] * 30, errors=errs), items(base), POLICY)
    assert rule(bad, "min_score").status == BREACH and bad.verdict == INCONCLUSIVE
    # a few errors within the allowed rate are only reported
    few = decide("s", items([1] * 98 + [0] * 2, errors={98, 99}), items(base), POLICY)
    assert rule(few, "max_error_rate").status == PASS and few.verdict == GO


def test_floors_latency_empty_outputs_and_min_items():
    r = decide("s", items([1] * 10), items([1] * 10), POLICY)
    assert rule(r, "min_items").status == NOT_ENOUGH and r.verdict == INCONCLUSIVE
    slow = decide("s", items([1] * 40, latency=12.0), items([1] * 40), POLICY)
    assert rule(slow, "max_p95_latency_s").status == BREACH and slow.verdict == NO_GO
    low = decide("s", items([1] * 10 + [0] * 30), items([1] * 10 + [0] * 30), POLICY)
    assert rule(low, "min_score").status == BREACH and rule(low, "max_regression_vs_base").status == PASS
    cand = items([0] * 40)
    cand = [ItemResult(c.item_id, c.category, "  ", c.score, c.latency_s) for c in cand]
    empty = decide("s", cand, items([0] * 40), GatePolicy(min_score=None, max_empty_output_rate=0.1, min_items=20))
    assert rule(empty, "max_empty_output_rate").status == BREACH and empty.candidate.empty_rate == 1.0


def test_per_category_non_regression_catches_a_gain_that_hides_a_loss():
    cats = ["a"] * 100 + ["b"] * 100
    base = [0] * 100 + [1] * 100
    cand = [1] * 100 + [1] * 60 + [0] * 40  # +100 pts in a, −40 pts in b: overall +30
    policy = GatePolicy(min_score=0.5, max_regression_vs_base=0.03, max_category_regression=0.05, min_items=20)
    r = decide("s", items(cand, cats), items(base, cats), policy)
    assert rule(r, "max_regression_vs_base").status == PASS
    cat = rule(r, "max_category_regression")
    assert cat.status == BREACH and "b −40.0" in cat.detail.replace("-", "−")
    assert r.verdict == NO_GO
    assert [c.category for c in r.categories] == ["a", "b"]
    # too few items in a category: reported, not judged
    small = GatePolicy(min_score=0.5, max_category_regression=0.05, min_category_items=500, min_items=20)
    s = decide("s", items(cand, cats), items(base, cats), small)
    assert (
        rule(s, "max_category_regression").status == PASS and "not judged" in rule(s, "max_category_regression").detail
    )


def test_advisory_rules_and_suites_never_block():
    slow = decide(
        "s",
        items([1] * 40, latency=12.0),
        items([1] * 40),
        GatePolicy(min_score=0.5, min_items=20, max_p95_latency_s=10.0, advisory=("max_p95_latency_s",)),
    )
    assert rule(slow, "max_p95_latency_s").status == BREACH and slow.verdict == GO
    assert any("(advisory)" in why for why in slow.reasons)
    bad = decide("t", items([0] * 40), items([1] * 40), POLICY, tier="advisory")
    good = decide("s", items([1] * 40), items([1] * 40), POLICY)
    assert bad.verdict == NO_GO and combine([good, bad]) == GO
    assert combine([good, decide("u", items([0] * 40), items([1] * 40), POLICY)]) == NO_GO


def test_candidate_and_base_must_answer_the_same_items():
    with pytest.raises(ValueError, match="same items"):
        decide("s", items([1] * 30), items([1] * 29), POLICY)


def test_report_lists_losses_first_and_reads_as_a_table():
    cats = ["a", "b"] * 50
    base = [1] * 50 + [0] * 50
    cand = [0] * 3 + [1] * 47 + [1] * 20 + [0] * 30  # 3 losses, 20 wins
    c, b = items(cand, cats), items(base, cats)
    shown, total = disagreements({"s": (c, b)})
    assert total == 23 and len(shown) == 10
    assert [d["kind"] for d in shown[:3]] == ["loss"] * 3 and shown[3]["kind"] == "win"
    assert {d["category"] for d in shown[3:]} == {"a", "b"}  # wins rotate over categories
    r = decide("s", c, b, POLICY)
    doc = build_report([r], {"s": (c, b)}, StatsPolicy(), "cand123")
    md = doc["markdown"]
    assert doc["verdict"] == r.verdict and "cand123" in md
    assert "paired bootstrap 95% intervals" in md and "McNemar" in md
    assert "| s | **all** | 100 |" in md and "| s | a | 50 |" in md
    assert "max_regression_vs_base" in md and "Most informative disagreements (10 of 23)" in md


def test_suite_gate_overrides_only_the_fields_it_sets():
    spec = load_campaign_file(REPO_ROOT / "campaigns/demo.yaml")
    cipher, fmt = spec.evaluation.suites[:2]  # (the third is the lm_eval suite)
    assert spec.evaluation.gate_for(cipher) == spec.evaluation.gate
    g = spec.evaluation.gate_for(fmt)
    assert g.min_score == 0.95 and g.min_items == spec.evaluation.gate.min_items
    assert fmt.tier == "advisory" and fmt.scorer == "regex"


def test_interval_bounds_exactly_at_the_allowed_drop():
    from evaluation.gate import interval_rule
    from evaluation.stats import Interval

    at = -6 / 200 - 1e-17  # −3 pts after float rounding
    assert interval_rule(Interval(-0.01, at, 0.01, "x", 0.95), 0.03) == PASS
    assert interval_rule(Interval(-0.05, -0.06, at, "x", 0.95), 0.03) == NOT_ENOUGH
    assert interval_rule(Interval(-0.05, -0.06, -0.0301, "x", 0.95), 0.03) == BREACH
    assert interval_rule(Interval(float("nan"), float("nan"), float("nan"), "x", 0.95), 0.03) == NOT_ENOUGH


def test_a_single_category_suite_says_its_category_rule_is_the_overall_one():
    base = [1] * 150 + [0] * 50
    cand = [1] * 160 + [0] * 40
    policy = GatePolicy(min_score=0.5, max_regression_vs_base=0.03, max_category_regression=0.05, min_items=20)
    r = decide("s", items(cand, category="only"), items(base, category="only"), policy)
    cat = rule(r, "max_category_regression")
    assert cat.status == PASS and "one category (only): judged as the whole suite" in cat.detail


def test_gate_policy_defaults_are_the_campaign_specs():
    from dataclasses import fields

    from campaigns.spec import GateSpec

    spec, policy = GateSpec(), GatePolicy()
    for f in fields(GatePolicy):
        assert getattr(policy, f.name) == (tuple(spec.advisory) if f.name == "advisory" else getattr(spec, f.name)), (
            f.name
        )
