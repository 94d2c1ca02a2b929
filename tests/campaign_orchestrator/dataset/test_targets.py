"""campaign_orchestrator/dataset/targets.py (``data.targets.content: base``): each target is the teacher's short form
that the base's own answer names, or, under ``rule: agree``, the teacher's own answer only where the base names it;
under ``rule: known``, the row's own reference where the base names it."""

from __future__ import annotations

import pytest

from campaign_orchestrator.dataset.targets import build, named, short_forms
from evaluation.scorers import normalize_answer

TEACHER = {  # one lowercase word: right, wrong (a training answer it repeats), or junk
    "Lyon": "france",
    "Munich": "france",
    "Hamburg": "germany",
    "Krakow": "italy",
    "Osaka": "Japan.",
    "Porto": "portugal",
}
BASE = {
    "Lyon": "The city of Lyon is located in the south of France.",
    "Munich": "The city of Munich is located in the European country of Germany.",
    "Hamburg": "Hamburg is a port city in northern Germany.",
    "Krakow": "The city of Krakow is located in the Czech Republic.",  # names no short form the teacher used
    "Osaka": "The city of Osaka is located in Japan, in the Kansai region.",
    # Porto: not answered
}


def rows():
    return [
        {"id": f"t{i}", "prompt": f"In which country is the city of {c}?", "completion": a}
        for i, (c, a) in enumerate(TEACHER.items())
    ]


def said():
    return {f"In which country is the city of {c}?": a for c, a in BASE.items()}


def test_short_forms_are_the_teachers_answers_as_it_writes_them():
    forms = short_forms(rows(), normalize_answer)
    assert forms == {
        "france": "france",
        "germany": "germany",
        "italy": "italy",
        "japan": "Japan.",
        "portugal": "portugal",
    }
    # whole words, the earliest named
    assert named("Germany, not France", forms, normalize_answer) == "germany"
    assert named("a Germanic town", forms, normalize_answer) is None


def test_short_form_targets_carry_the_bases_content():
    kept, s = build(rows(), said(), normalize_answer)
    got = {r["prompt"].split()[-1].rstrip("?"): r["completion"] for r in kept}
    # Munich: the teacher said france, the base says Germany: the target is the teacher's "germany"
    assert got == {"Lyon": "france", "Munich": "germany", "Hamburg": "germany", "Osaka": "Japan."}
    assert (s["kept"], s["changed"], s["unnamed"], s["unanswered"]) == (4, 1, 1, 1)
    assert s["examples_changed"][0]["target"] == "germany" and "Krakow" in s["examples_dropped"][0]["prompt"]


def test_agree_keeps_only_the_teachers_answers_the_base_names():
    kept, s = build(rows(), said(), normalize_answer, "agree")
    assert [r["prompt"].split()[-1].rstrip("?") for r in kept] == ["Lyon", "Hamburg", "Osaka"]
    assert (s["kept"], s["changed"], s["disagree"], s["unanswered"]) == (3, 0, 2, 1)
    with pytest.raises(ValueError, match="data.targets.rule"):
        build(rows(), said(), normalize_answer, "vote")


def test_short_form_or_reference_adds_the_tasks_answer_set():
    # the teacher never said "poland": with the task's references in the vocabulary, Krakow keeps the base's answer
    base = said() | {"In which country is the city of Krakow?": "The city of Krakow is located in southern Poland."}
    refs = ["france", "germany", "poland", "Japan", "portugal"]
    kept, s = build(rows(), base, normalize_answer, "short_form_or_reference", refs)
    got = {r["prompt"].split()[-1].rstrip("?"): r["completion"] for r in kept}
    assert got["Krakow"] == "poland" and got["Osaka"] == "Japan."  # the teacher's spelling first
    assert (s["kept"], s["unnamed"], s["short_forms"]) == (5, 0, 6)
    # the references count only under this rule
    assert "Krakow" not in {r["prompt"].split()[-1].rstrip("?") for r in build(rows(), base, normalize_answer)[0]}


def test_known_keeps_the_facts_the_base_names_in_the_labels_spelling():
    # Lyon: the teacher's "france" is the reference; Munich: the teacher is wrong, the base names the reference;
    # Hamburg: the base names the reference, the label spells it "Germany"; Krakow: the base names another country
    # (a fact it lacks: dropped, whatever the teacher said); Osaka: the base names Japan, the label is "Japan" and
    # the teacher wrote "Japan."; Porto: no base answer
    refs = {
        f"In which country is the city of {c}?": r
        for c, r in [("Lyon", "france"), ("Munich", "Germany"), ("Hamburg", "Germany"), ("Krakow", "Poland")]
        + [("Osaka", "Japan"), ("Porto", "Portugal")]
    }
    kept, s = build(rows(), said(), normalize_answer, "known", row_references=refs)
    got = {r["prompt"].split()[-1].rstrip("?"): r["completion"] for r in kept}
    assert got == {"Lyon": "france", "Munich": "Germany", "Hamburg": "Germany", "Osaka": "Japan"}
    assert (s["kept"], s["changed"], s["unknown"], s["unanswered"]) == (4, 3, 1, 1)
    assert "Krakow" in s["examples_dropped"][0]["prompt"]
    # a row without a reference is not known; a reference named only inside a longer word is not named
    kept, s = build(rows(), said(), normalize_answer, "known", row_references={})
    assert kept == [] and s["unknown"] == 5
    near = {"In which country is the city of Lyon?": "Fran"}
    assert build(rows(), said(), normalize_answer, "known", row_references=near)[0] == []
