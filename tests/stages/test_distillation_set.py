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
