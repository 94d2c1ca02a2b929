"""The campaign spec: valid files load; every kind of bad field names file, field, line and expectation."""

import typing

import pytest
import yaml

from campaigns.loader import CampaignError, default_campaign_files, load_campaigns, parse_campaign_text
from campaigns.spec import CampaignSpec
from tests.support import REPO_ROOT as REPO

DEMO = (REPO / "campaigns" / "demo.yaml").read_text()


def _with(mutate) -> str:
    data = yaml.safe_load(DEMO)
    mutate(data)
    return yaml.safe_dump(data, sort_keys=False)


def _problems(text: str, path: str = "campaigns/bad.yaml") -> str:
    with pytest.raises(CampaignError) as e:
        parse_campaign_text(text, path)
    return str(e.value)


def test_shipped_campaigns_are_valid():
    loaded = load_campaigns(default_campaign_files())
    assert loaded.errors == []
    assert {"demo", "demo_broken"} <= set(loaded.campaigns)
    demo = loaded.campaigns["demo"]
    t = demo.training
    assert t.effective_batch == t.micro_batch_size * t.nodes * t.processes_per_node * t.gradient_accumulation_steps
    assert demo.student.quantization.load_in_4bit is True
    assert loaded.campaigns["demo_broken"].training.learning_rate == 0.0


def test_unknown_key_names_file_field_line_and_allowed_keys():
    text = DEMO.replace("  learning_rate: 5.0e-3", "  learning_rate: 5.0e-3\n  learnin_rate: 1.0")
    msg = _problems(text)
    line = text.splitlines().index("  learnin_rate: 1.0") + 1
    assert f"campaigns/bad.yaml:{line}: training.learnin_rate: unknown key" in msg
    assert "learning_rate" in msg and "micro_batch_size" in msg  # lists what is allowed


def test_the_old_spelling_of_execution_executor_is_read_with_a_warning_naming_the_new_one():
    # execution.engine (before issue 44) is execution.executor now: a file that says it still loads, the same
    with pytest.warns(FutureWarning, match=r"execution.engine is renamed execution.executor: write `executor: ray`"):
        old = parse_campaign_text(_with(lambda d: d.update(execution={"engine": "ray", "replicas": 3})))
    new = parse_campaign_text(_with(lambda d: d.update(execution={"executor": "ray", "replicas": 3})))
    assert old.execution == new.execution and new.execution.executor == "ray"
    msg = _problems(_with(lambda d: d.update(execution={"engine": "ray", "executor": "local"})))
    assert "bad.yaml" in msg and "execution" in msg and "keep only `executor: local`" in msg


def test_wrong_type_names_field_and_value():
    msg = _problems(_with(lambda d: d["training"].update(micro_batch_size="lots")))
    assert "training.micro_batch_size" in msg and "valid integer" in msg and "'lots'" in msg


def test_missing_required_section():
    msg = _problems(_with(lambda d: d.pop("teacher")))
    assert "teacher: required field is missing" in msg


def test_name_must_be_a_slug():
    msg = _problems(_with(lambda d: d.update(name="My Campaign")))
    assert "name: must be a slug" in msg and msg.count("'My Campaign'") == 1  # quoted once, not twice


def test_steps_and_epochs_are_exclusive():
    msg = _problems(_with(lambda d: d["training"].update(epochs=2)))
    assert "training: set exactly one of `max_steps` or `epochs`" in msg


def test_bad_regex_and_openai_without_url():
    msg = _problems(_with(lambda d: d["data"]["filters"].update(format_regex="[a-z")))
    assert "data.filters.format_regex: not a valid regular expression" in msg
    msg = _problems(_with(lambda d: d["teacher"].update(backend="openai")))
    assert "teacher: backend 'openai' needs `base_url`" in msg


def test_bad_enum_and_range():
    msg = _problems(_with(lambda d: d["training"].update(sharding="zero3", learning_rate=-1)))
    assert "training.sharding" in msg and "'full', 'hybrid' or 'none'" in msg
    assert "training.learning_rate" in msg and "greater than or equal to 0" in msg


def test_list_items_are_located():
    msg = _problems(_with(lambda d: d["evaluation"]["suites"][0].update(scorer="bleu")))
    assert "evaluation.suites[0].scorer" in msg


def test_invalid_yaml_and_non_mapping():
    assert "not valid YAML" in _problems("name: [unclosed")
    assert "expected a mapping" in _problems("- a\n- b\n")


def test_broken_file_does_not_stop_the_others(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(DEMO.replace("name: demo", "name: good_one"))
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEMO.replace("name: demo", "name: bad_one").replace("nodes: 1", "nodes: zero"))
    dup = tmp_path / "dup.yaml"
    dup.write_text(DEMO.replace("name: demo", "name: good_one"))
    loaded = load_campaigns([str(good), str(bad), str(dup)])
    assert list(loaded.campaigns) == ["good_one"]
    rendered = [e.render() for e in loaded.errors]
    assert any("bad.yaml" in r and "training.nodes" in r for r in rendered)
    assert any("dup.yaml" in r and "already defined" in r for r in rendered)


def test_schema_is_documented():
    """Every field of the spec carries a description or is a nested documented section."""
    undocumented = []

    def walk(model, prefix):
        for name, f in model.model_fields.items():
            ann = f.annotation
            models = [a for a in (typing.get_args(ann) or (ann,)) if hasattr(a, "model_fields")]
            ann = models[0] if models else ann
            sub = getattr(ann, "model_fields", None)
            if sub is not None:
                walk(ann, f"{prefix}{name}.")
            elif not f.description:
                undocumented.append(prefix + name)

    walk(CampaignSpec, "")
    assert undocumented == [], f"document these fields in campaigns/spec/: {undocumented}"


def test_example_loss_normalization_is_for_the_sequence_loss_only():
    from campaigns.spec import TrainingSpec

    assert TrainingSpec(epochs=1).loss_normalization == "token"
    assert TrainingSpec(epochs=1, loss_normalization="example").loss_normalization == "example"
    with pytest.raises(ValueError, match="weighs each example.s cross-entropy; it is not for"):
        TrainingSpec(epochs=1, loss_normalization="example", distillation={"loss": "logits"})
