"""evaluation/diagnosis.py on four shrunken planted failures (memorised, not learned, format drift, forgot), a
clean candidate, and conflicting task/replay data: each names its cause and the recipe change."""

from __future__ import annotations

from evaluation.diagnosis import Context, SuiteItems, conflicts, diagnose
from evaluation.gate import ItemResult


def items(outputs, refs, scores, cats=None):
    cats = cats or ["all"] * len(outputs)
    return [
        ItemResult(str(i), c, o, s, 0.1, None, f"q{i}", r)
        for i, (o, r, s, c) in enumerate(zip(outputs, refs, scores, cats, strict=True))
    ]


REFS = ["cats", "dogs", "boxes", "hats", "cups", "pens", "keys", "cars"]
GENERAL_REFS = ["Paris", "4", "blue", "cold", "Rome", "6", "green", "hot"]
GENERAL_BASE = [f"The answer is {r} of course." for r in GENERAL_REFS]
CATS = ["capital", "arithmetic", "color", "opposite"] * 2


def general(candidate_outputs, candidate_scores):
    return SuiteItems(
        "general",
        items(candidate_outputs, GENERAL_REFS, candidate_scores, CATS),
        items(GENERAL_BASE, GENERAL_REFS, [1.0] * 8, CATS),
        max_regression=0.1,
    )


def causes(d):
    return [c["cause"] for c in d["causes"]]


def healthy_general():
    return general(GENERAL_BASE, [1.0] * 8)


def test_memorised():
    task = SuiteItems(
        "plurals",
        items(["cat", "dog", "box", "hat", "cup", "pen", "key", "car"], REFS, [0.0] * 8),
        items(["x"] * 8, REFS, [0.0] * 8),
    )
    train = items(REFS, REFS, [1.0] * 7 + [0.0])
    d = diagnose(task, [healthy_general()], train, Context(has_replay=True))
    assert causes(d) == ["memorised"]
    assert "88%" in d["causes"][0]["evidence"] and "training.selection" in d["causes"][0]["fix"]


def test_not_learned_the_right_format_the_wrong_content():
    wrong = ["bats", "logs", "foxes", "mats", "pups", "hens", "bees", "jars"]  # one word each: the format is right
    task = SuiteItems("plurals", items(wrong, REFS, [0.0] * 8), items(["x"] * 8, REFS, [0.0] * 8))
    d = diagnose(task, [healthy_general()], items(wrong, REFS, [0.0] * 8), Context(has_replay=True))
    assert causes(d) == ["not learned: the right format, the wrong content"]
    assert "100% of the answers have the reference's format" in d["causes"][0]["evidence"]


def test_not_learned_at_all_points_at_the_steps():
    ramble = [f"The plural of {r[:-1]} is a word that means many things." for r in REFS]
    task = SuiteItems("plurals", items(ramble, REFS, [0.0] * 8), items(ramble, REFS, [0.0] * 8))
    d = diagnose(task, [healthy_general()], None, Context(has_replay=True))
    assert causes(d) == ["not learned"] and "training.epochs" in d["causes"][0]["fix"]


def test_format_drift_empty_outputs_and_shorter_answers():
    task = SuiteItems("plurals", items(REFS, REFS, [1.0] * 8), items(["x"] * 8, REFS, [0.0] * 8))
    clipped = ["", "", "Paris", "4", "blue", "cold", "Rome", "6"]  # empty, and one word where the base wrote six
    d = diagnose(
        task, [general(clipped, [0.0, 0.0] + [1.0] * 6)], items(REFS, REFS, [1.0] * 8), Context(has_replay=False)
    )
    assert causes(d)[:2] == ["format drift", "format drift"]
    assert "25% empty answers" in d["causes"][0]["evidence"] and "median answer 1 words" in d["causes"][1]["evidence"]
    assert "data.replay" in d["causes"][0]["fix"]


def test_forgot_by_category_names_the_missing_replay():
    task = SuiteItems("plurals", items(REFS, REFS, [1.0] * 8), items(["x"] * 8, REFS, [0.0] * 8))
    forgot = [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]  # arithmetic lost
    d = diagnose(
        task,
        [general(GENERAL_BASE, forgot)],
        items(REFS, REFS, [1.0] * 8),
        Context(has_replay=False, teacher_is_base=False),
    )
    assert causes(d) == ["forgot (missing replay)"]
    c = d["causes"][0]
    assert c["by_category"]["arithmetic"] == -1.0 and "arithmetic -100%" in c["evidence"]
    assert "add data.replay" in c["fix"]
    # with replay at a small share, the fix is a larger share; a context-distillation teacher is its own replay
    d = diagnose(task, [general(GENERAL_BASE, forgot)], None, Context(has_replay=True, replay_share=0.2))
    assert causes(d) == ["forgot"] and "raise data.replay.share" in d["causes"][0]["fix"]


def test_a_healthy_candidate_has_no_cause():
    task = SuiteItems("plurals", items(REFS, REFS, [1.0] * 8), items(["x"] * 8, REFS, [0.0] * 8))
    d = diagnose(task, [healthy_general()], items(REFS, REFS, [1.0] * 8), Context(has_replay=True))
    assert d["causes"] == [] and "No failure pattern" in d["markdown"]


def test_conflicting_data_same_prompt_shape_different_answer_formats():
    task = [(f"What is the capital of {c}?", c.lower()) for c in ["France", "Italy", "Spain", "Peru"]]
    replay = [(f"What is the largest city of {c}?", f"The largest city of {c} is a big one.") for c in "ABCD"]
    replay += [("Who wrote Hamlet?", "Shakespeare wrote Hamlet.")] * 3
    found = conflicts(task, replay)
    assert [f["shape"] for f in found] == ["what is"] and found[0]["task_words"] == 1
    d = diagnose(
        SuiteItems("t", items(REFS, REFS, [1.0] * 8), items(REFS, REFS, [1.0] * 8)),
        [],
        None,
        Context(has_replay=True, conflicts=found),
    )
    assert causes(d) == ["conflicting data"]
