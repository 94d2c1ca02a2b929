"""stages/distillation_set.py's ``data.targets.prefix_space``: each task target after one space, the replay rows as
they are, and the setting in the stage's content key only when on (the keys from before it stay: the golden test in
tests/stages/test_content_keys.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from campaigns.loader import load_campaign_file, parse_campaign_text
from stages import distillation_set
from tests.stages.test_content_keys import KeyStore, stand_ins  # noqa: F401 - the fixture
from tests.support import REPO_ROOT

FACTS = REPO_ROOT / "campaigns" / "smollm2_facts.yaml"


def _ctx():
    said = []
    return SimpleNamespace(log=SimpleNamespace(info=said.append)), said


def _facts(prefix_space: bool):
    text = FACTS.read_text()
    assert "prefix_space: true" in text
    text = text.replace("prefix_space: true", f"prefix_space: {str(prefix_space).lower()}")
    return parse_campaign_text(text, str(FACTS))


def test_each_task_target_gets_exactly_one_space_and_only_when_asked():
    rows = [{"id": "a", "completion": "Poland"}, {"id": "b", "completion": "\n  Chile"}, {"id": "c", "completion": ""}]
    ctx, said = _ctx()
    on = distillation_set.with_prefix_space(_facts(True), ctx, rows)
    assert [r["completion"] for r in on] == [" Poland", " Chile", ""]
    assert [r["id"] for r in on] == ["a", "b", "c"] and rows[0]["completion"] == "Poland"  # the input is untouched
    assert said == ["data.targets.prefix_space: 3 task targets written after one space"]
    ctx, said = _ctx()
    assert distillation_set.with_prefix_space(_facts(False), ctx, rows) == rows and said == []


@pytest.mark.usefixtures("stand_ins")
def test_the_setting_is_keyed_when_on_and_absent_from_the_key_when_off(tmp_path):
    store = KeyStore(root=str(tmp_path))
    gens, prompts = {"key": "g" * 20}, {"key": "p" * 20, "train_sha256": "t" * 64, "heldout_sha256": "h" * 64}
    on, off = _facts(True), _facts(False)
    assert on.data.targets.key_fields()["prefix_space"] is True
    assert "prefix_space" not in off.data.targets.key_fields()  # a campaign from before the field keeps its key
    assert off.data.targets.key_fields() == {
        k: v for k, v in off.data.targets.model_dump().items() if k != "prefix_space"
    }
    keys = {distillation_set.content_key(s, gens, prompts, store) for s in (on, off)}
    assert len(keys) == 2
    # with the teacher's answers as targets (content: teacher), the setting alone changes the key too
    api = load_campaign_file(REPO_ROOT / "campaigns" / "smollm2_api.yaml")
    targets = api.data.targets.model_copy(update={"prefix_space": True})
    spaced = api.model_copy(update={"data": api.data.model_copy(update={"targets": targets})})
    assert distillation_set.content_key(api, gens, prompts, store) != distillation_set.content_key(
        spaced, gens, prompts, store
    )


def _known(tmp_path, table: list[dict]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(table), path)
    spec = parse_campaign_text(FACTS.read_text(), str(FACTS))
    assert spec.data.targets.rule == "known"  # the shipped example's rule
    return spec, {"train_path": str(path)}


def test_rule_known_takes_each_rows_reference_from_the_prompt_table(tmp_path, monkeypatch):
    from campaign_orchestrator.generation.runner import GenerationResult, GenerationStats

    base = {
        "In which country is the city of Gdansk?": "The city of Gdansk is in northern Poland.",
        "In which country is the city of Ghent?": "The city of Ghent is located in the Netherlands.",
    }
    asked = []

    def answered(spec, ctx, chosen, sampling):
        asked.extend(p["prompt"] for p in chosen)
        return GenerationResult([p | {"completion": base[p["prompt"]]} for p in chosen], GenerationStats()), []

    monkeypatch.setattr(distillation_set, "_replay_by_base", answered)
    spec, prompts = _known(
        tmp_path,
        [
            {"id": f"t{i}", "prompt": p, "reference": r}
            for i, (p, r) in enumerate(zip(base, ["Poland", "Belgium"], strict=True))
        ],
    )
    teacher = [{"id": f"t{i}", "prompt": p, "completion": "Southeast Asia"} for i, p in enumerate(base)]
    ctx, said = _ctx()
    rows, summary, lines = distillation_set.with_base_targets(spec, ctx, teacher, prompts)
    assert asked == list(base)  # each prompt asked of the base once
    assert [(r["id"], r["completion"]) for r in rows] == [("t0", "Poland")]  # Ghent: the base names another country
    assert (summary["rule"], summary["kept"], summary["changed"], summary["unknown"]) == ("known", 1, 1, 1)
    assert said == [
        "data.targets: content base (known): 1 of 2 task rows kept, 1 with the base's answer instead of the teacher's"
    ]


def test_rule_known_without_references_says_which_file_lacks_them(tmp_path):
    spec, prompts = _known(tmp_path, [{"id": "t0", "prompt": "In which country is the city of Gdansk?"}])
    with pytest.raises(ValueError, match=r"data.targets.rule: known .* no training prompt in .*facts-train.jsonl"):
        distillation_set.with_base_targets(spec, _ctx()[0], [], prompts)


def test_replay_answers_cut_at_their_token_limit_are_named_in_a_warning(monkeypatch):
    from campaigns.loader import parse_campaign_text as parse

    warned = []
    ctx = SimpleNamespace(log=SimpleNamespace(info=lambda m: None, warning=warned.append))

    def answers(cut: int):
        rows = [
            {"id": f"replay:r{i}", "prompt": f"What is {i}?", "completion": f"It is {i}.", "finish_reason": "stop"}
            for i in range(10)
        ]
        for r in rows[:cut]:
            r["finish_reason"] = "length"
        monkeypatch.setattr(distillation_set, "answer_replay", lambda spec, ctx, n: (rows, {}, []))

    spec = parse(FACTS.read_text(), str(FACTS))
    task = [{"id": f"t{i}", "prompt": f"In which country is the city of C{i}?", "completion": " X"} for i in range(10)]
    answers(cut=4)
    rows, replay, _ = distillation_set.with_replay(spec, ctx, task)
    assert replay["rows"] == 6 and replay["filter_counts"]["truncated"] == 4 and len(rows) == 16
    assert len(warned) == 1 and "4 of 10 replay answers reached data.replay.max_new_tokens (128)" in warned[0]
    assert "is 38% of the mix, not the 50% asked" in warned[0] and "Raise data.replay.max_new_tokens" in warned[0]
    warned.clear()
    answers(cut=0)
    distillation_set.with_replay(spec, ctx, task)
    assert warned == []
