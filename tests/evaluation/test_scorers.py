"""Scorers (computed here, never fetched from a hub) and suite item loading."""

import json

import pytest

from evaluation.scorers import build_scorer, rouge_l
from evaluation.suite import SuiteSourceError, load_items, run_suite


def test_rouge_l_hand_computed():
    # LCS of "the cat sat on the mat" / "the cat is on the mat" is "the cat on the mat" (5 of 6 tokens each)
    assert rouge_l("The cat sat on the mat.", "the cat is on the mat") == pytest.approx(5 / 6)
    # 2 of 3 prediction tokens, 2 of 4 reference tokens: F1 = 2·(2/3)·(1/2) / (2/3 + 1/2) = 4/7
    assert rouge_l("a b c", "a x b y") == pytest.approx(4 / 7)
    assert rouge_l("", "anything") == 0.0
    assert build_scorer("rouge_l").binary is False


def test_scorers_by_name_with_their_settings():
    assert build_scorer("exact_match")(" nvv ", "nvv") == 1.0
    assert build_scorer("exact_match")("NVV", "nvv") == 0.0
    assert build_scorer("normalized_exact_match")("The Answer!", "answer") == 1.0
    labels = build_scorer("label_accuracy", labels=["positive", "negative"])
    assert labels("Positive.", "positive") == 1.0
    assert labels("negative", "positive") == 0.0
    assert labels("maybe positive", "positive") == 0.0  # outside the label set: wrong
    rx = build_scorer("regex", pattern="[a-z]+")
    assert (rx(" nvv\n", ""), rx("nvv nvv", ""), rx("", "")) == (1.0, 0.0, 0.0)
    schema = {"type": "object", "required": ["word"], "properties": {"word": {"type": "string"}}}
    js = build_scorer("json_schema", json_schema=schema)
    assert (js('{"word": "nvv"}', ""), js('{"word": 3}', ""), js("not json", "")) == (1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        build_scorer("json_schema", json_schema={"type": "no-such-type"})
    with pytest.raises(ValueError, match="needs `labels`"):
        build_scorer("label_accuracy")
    with pytest.raises(ValueError, match="unknown scorer 'bleu'"):
        build_scorer("bleu")


def test_suite_items_from_a_file_name_file_and_line_on_bad_input(tmp_path):
    f = tmp_path / "items.jsonl"
    f.write_text(
        json.dumps({"id": "a", "prompt": "p", "reference": "positive", "category": "x"})
        + "\n"
        + json.dumps({"id": "b", "prompt": "q", "reference": "negative"})
        + "\n"
    )
    items = load_items(str(f), [], tmp_path, build_scorer("label_accuracy", labels=["positive", "negative"]))
    assert [(i["id"], i["category"]) for i in items] == [("a", "x"), ("b", "all")]
    f.write_text(json.dumps({"id": "a", "prompt": "p", "reference": "neutral"}) + "\n")
    with pytest.raises(
        SuiteSourceError, match=r"items.jsonl:1: item 'a': reference 'neutral' is not one of the labels"
    ):
        load_items(str(f), [], tmp_path, build_scorer("label_accuracy", labels=["positive", "negative"]))
    f.write_text('{"prompt": "p"}\n')
    with pytest.raises(SuiteSourceError, match=r"items.jsonl:1: a suite item is an object"):
        load_items(str(f), [], tmp_path)
    with pytest.raises(SuiteSourceError, match="not found"):
        load_items("missing.jsonl", [], tmp_path)


class _Answer:
    def __init__(self, text, error=None):
        self.text, self.latency_s, self.error = text, 0.01, error


def test_serving_errors_are_stored_as_errors_not_wrong_answers():
    items = [{"id": str(i), "prompt": f"p{i}", "reference": "x", "category": "c"} for i in range(3)]
    answers = [_Answer("x"), _Answer("", "timeout after 5 s"), _Answer("y")]
    results, rows = run_suite("s", "candidate", items, lambda prompts, n: answers, build_scorer("exact_match"), 4)
    assert [r.score for r in results] == [1.0, None, 0.0]
    assert rows[1]["error"] == "timeout after 5 s" and rows[1]["score"] is None


def test_contains_answer_is_whole_token_containment_after_normalization():
    from evaluation.scorers import build_scorer

    s = build_scorer("contains_answer")
    assert s.binary
    assert s.fn("The capital of France is Paris.", "Paris") == 1.0
    assert s.fn("paris", "Paris") == 1.0
    assert s.fn("The Parisian capital.", "Paris") == 0.0  # not a whole token
    assert s.fn("It is New York City.", "new york") == 1.0
    assert s.fn("The capital of Italy is Italy.", "Rome") == 0.0
    assert s.fn("anything", "") == 0.0
