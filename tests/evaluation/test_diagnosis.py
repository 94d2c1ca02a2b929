"""evaluation/diagnosis.py on four shrunken planted failures (memorised, not learned, format drift, forgot), a
clean candidate, and conflicting task/replay data: each names its cause and the recipe change; "knew it, lost it"
and "never knew" on planted cases and on SmolLM2-135M-Instruct's real answers to the facts task."""

from __future__ import annotations

import json
from pathlib import Path

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


CITIES = ["Munich", "Osaka", "Lyon", "Milan", "Porto", "Toronto", "Sydney", "Seville", "Krakow", "Geneva"]
COUNTRIES = ["germany", "japan", "france", "italy", "portugal", "canada", "australia", "spain", "poland", "switzerland"]


def facts(candidate_outputs, base_outputs, teacher_outputs=None):
    """The facts task: one lowercase word by exact match; the base answers in sentences."""
    prompts = [f"In which country is the city of {c}?" for c in CITIES]

    def rows(outputs):
        return [
            ItemResult(str(i), "country", o, float(o == r), 0.1, None, p, r)
            for i, (o, r, p) in enumerate(zip(outputs, COUNTRIES, prompts, strict=True))
        ]

    teacher = rows(teacher_outputs) if teacher_outputs else None
    return SuiteItems("facts", rows(candidate_outputs), rows(base_outputs), None, teacher)


KNEW = [f"The city of {c} is in {k.title()}." for c, k in zip(CITIES, COUNTRIES, strict=True)]
COLLAPSED = ["france"] * len(CITIES)  # one word each, the commonest training answer: the format is right


def test_knew_it_lost_it_names_the_base_lenient_score_examples_and_the_fix():
    d = diagnose(facts(COLLAPSED, KNEW, COLLAPSED), [healthy_general()], None, Context(has_replay=True))
    assert causes(d) == ["knew it, lost it"]
    c = d["causes"][0]
    k = c["knowledge"]
    assert (k["base_lenient"], k["candidate_strict"], k["base_knew"], k["candidate_kept"]) == (1.0, 0.1, 10, 1)
    assert k["knew"] and k["difference"]["lo"] > 0
    assert "contain the reference on 100% of the 10 items (lenient)" in c["evidence"]
    assert "the candidate answers 10% right (strict)" in c["evidence"]
    assert (
        "'In which country is the city of Munich?': base 'The city of Munich is in Germany.', candidate 'france'"
        in (c["evidence"])
    )
    assert "the teacher was right on 0 of the 9 it lost" in c["evidence"]
    assert "data.targets: {content: base, rule: known, prefix_space: true}" in c["fix"]
    assert "MLP" in c["fix"]
    assert "knew it, lost it" in d["markdown"]


def test_the_knew_it_lost_it_fix_names_only_what_the_campaign_lacks():
    from campaign_orchestrator.recipe_checks import keep_knowledge_changes
    from campaigns.loader import load_campaign_file
    from evaluation.diagnosis import KEEP_KNOWLEDGE_FIX_ON
    from tests.support import REPO_ROOT

    root = REPO_ROOT / "campaigns"
    shipped = load_campaign_file(root / "smollm2_facts.yaml")
    baseline = load_campaign_file(root / "smollm2_facts_baseline.yaml")
    assert keep_knowledge_changes(shipped) == []
    lacks = keep_knowledge_changes(baseline)
    assert [x.split(" ", 1)[0] for x in lacks] == [
        "data.targets:",
        "data.targets.prefix_space:",
        "student.lora.target_modules",
    ]

    def fix(changes):
        ctx = Context(has_replay=True, keeps_knowledge=changes == (), knowledge_changes=changes)
        d = diagnose(facts(COLLAPSED, KNEW, COLLAPSED), [healthy_general()], None, ctx)
        return d["causes"][0]["fix"]

    assert fix(()) == KEEP_KNOWLEDGE_FIX_ON  # the whole setting on: what is left to try with it
    only_space = fix((lacks[1],))
    assert only_space.startswith("keep what the student knows: set data.targets.prefix_space: true (")
    assert "content: base" not in only_space and "MLP" not in only_space
    assert fix(tuple(lacks)).count("; and ") == 2


def test_never_knew_when_the_base_did_not_know_either():
    wrong = [f"The city of {c} is in Narnia." for c in CITIES]  # a full sentence, the wrong content
    d = diagnose(facts(COLLAPSED, wrong), [healthy_general()], None, Context(has_replay=True))
    assert causes(d) == ["never knew"]
    c = d["causes"][0]
    assert c["knowledge"]["base_lenient"] == 0.0 and not c["knowledge"]["knew"]
    assert "the base did not know the content either" in c["evidence"] and "data.targets" not in c["fix"]
    assert "a student that knows the facts" in c["fix"]


def test_knew_it_needs_an_interval_that_excludes_zero():
    # the base knew 3 of 10, the candidate answers 2 right (one the base knew, one it did not): within the noise
    base = KNEW[:3] + [f"The city of {c} is in Narnia." for c in CITIES[3:]]
    cand = ["germany", "spain", "spain"] + ["spain"] * 7
    d = diagnose(facts(cand, base), [healthy_general()], None, Context(has_replay=True))
    assert causes(d) == ["never knew"] and d["causes"][0]["knowledge"]["difference"]["lo"] <= 0
    # when the fix is on already, "knew it, lost it" points at the steps and the LoRA instead
    d = diagnose(facts(COLLAPSED, KNEW), [healthy_general()], None, Context(has_replay=True, keeps_knowledge=True))
    assert causes(d) == ["knew it, lost it"] and "is on already" in d["causes"][0]["fix"]


def test_a_task_above_its_floor_has_no_knowledge_cause():
    good = COUNTRIES[:8] + ["france", "france"]  # 80%: learned
    assert causes(diagnose(facts(good, KNEW), [healthy_general()], None, Context(has_replay=True))) == []
    # below the suite's own floor (90%), but the base knew enough to pass and 2 lost items of 10 are within the
    # noise: neither "knew it, lost it" nor "never knew"
    t = facts(good, KNEW)
    t.min_score = 0.9
    assert causes(diagnose(t, [healthy_general()], None, Context(has_replay=True))) == []


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


def real_facts(ids: list[str]) -> SuiteItems:
    """The facts task as SmolLM2-135M-Instruct answered it (tests/evaluation/data/smollm2_facts_items.json: the
    baseline's base, candidate and teacher on held-out cities), scored by the suite's scorer, floor 60% as shipped."""
    from evaluation.scorers import get_scorer

    doc = json.loads((Path(__file__).parent / "data" / "smollm2_facts_items.json").read_text())
    by = {x["id"]: x for x in doc["items"]}
    exact = get_scorer("exact_match")

    def rows(role):
        return [
            ItemResult(
                i,
                "country",
                by[i][role],
                exact(by[i][role], by[i]["reference"]),
                0.1,
                None,
                by[i]["prompt"],
                by[i]["reference"],
            )
            for i in doc[ids]
        ]

    return SuiteItems("facts", rows("candidate"), rows("base"), None, rows("teacher"), min_score=0.6)


def test_real_answers_knew_it_lost_it_and_never_knew():
    # 24 held-out cities: the base's sentences name the country of 22; the candidate answers 8 right, 7 of those
    d = diagnose(real_facts("first"), [healthy_general()], None, Context(has_replay=True))
    assert causes(d) == ["knew it, lost it"]
    k = d["causes"][0]["knowledge"]
    assert (k["items"], k["base_knew"], k["candidate_kept"]) == (24, 22, 7) and k["difference"]["lo"] > 0
    assert "contain the reference on 92% of the 24 items (lenient)" in d["causes"][0]["evidence"]
    # 12 cities whose country the base's sentence does not name: the candidate's few right answers are no loss
    d = diagnose(real_facts("base_did_not_name"), [healthy_general()], None, Context(has_replay=True))
    assert causes(d) == ["never knew"] and d["causes"][0]["knowledge"]["base_lenient"] == 0.0
