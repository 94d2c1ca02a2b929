"""On-policy distillation without a model: the spec (YAML `lambda`, contradictions named with file, field and what
to write), the graph of a campaign without a teacher stage, the step schedule, batches and teacher prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from campaigns.loader import CampaignError, load_campaign_file
from tests.support import REPO_ROOT

SHIPPED = REPO_ROOT / "campaigns" / "smollm2_on_policy.yaml"


def _write(tmp_path: Path, edit) -> Path:
    doc = yaml.safe_load(SHIPPED.read_text())
    edit(doc)
    (tmp_path / "campaigns").mkdir(exist_ok=True)
    path = tmp_path / "campaigns" / "c.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _error(tmp_path: Path, edit) -> str:
    with pytest.raises(CampaignError) as e:
        load_campaign_file(_write(tmp_path, edit))
    return str(e.value)


def test_shipped_campaign_parses_with_yaml_lambda():
    spec = load_campaign_file(SHIPPED)
    op = spec.training.distillation.on_policy
    assert spec.training.distillation.loss == "on_policy" and op.lambda_ == 1.0 and op.beta == 1.0
    assert spec.training.distillation.skips_teacher
    again = type(spec).model_validate(spec.model_dump())  # a sweep's with_params round trip (field names)
    assert again.training.distillation.on_policy == op


def _op(doc) -> dict:
    return doc["training"]["distillation"]["on_policy"]


@pytest.mark.parametrize(
    "edit, words",
    [
        (
            lambda d: _op(d).update({"lambda": 0.5}),
            ["c.yaml", "training.distillation.on_policy", "teacher_generations: generate", "lambda 0.5"],
        ),
        (
            lambda d: _op(d).update({"teacher_generations": "generate", "warmup": "sequence_kd"}),
            ["warmup: sequence_kd", "warmup_steps"],
        ),
        (lambda d: _op(d).update({"warmup_steps": 3}), ["warmup: sequence_kd", "remove warmup_steps"]),
        (lambda d: _op(d).update({"samples_per_round": 30}), ["samples_per_round (30)", "multiple", "= 8", "e.g. 24"]),
        (
            lambda d: (
                d["training"].update({"max_steps": 40})
                or _op(d).update({"teacher_generations": "generate", "warmup": "sequence_kd", "warmup_steps": 40})
            ),
            ["warmup_steps (40)", "max_steps 40"],
        ),
        (
            lambda d: d["teacher"].update({"backend": "vllm"}),
            ["on_policy", "'transformers'", "'openai'", "prompt_logprobs"],
        ),
        (
            lambda d: _op(d).update({"lambda": 1.5}),
            ["training.distillation.on_policy.lambda", "less than or equal to 1"],
        ),
        (
            lambda d: d.update(
                {
                    "sweep": {
                        "space": {"training.learning_rate": {"type": "log_uniform", "low": 1e-4, "high": 1e-3}},
                        "trials": 2,
                        "rungs": {"min_steps": 10},
                        "budget_usd": 0.1,
                    }
                }
            ),
            ["'on_policy' does not run under a `sweep`", "remove `sweep`"],
        ),
    ],
)
def test_contradictions_name_the_file_field_and_what_to_write(tmp_path, edit, words):
    msg = _error(tmp_path, edit)
    for w in words:
        assert w in msg, (w, msg)


def test_no_teacher_stage_in_the_graph_when_fully_on_policy(tmp_path):
    from assets.location import campaign_assets

    def stages(spec):
        out = {}
        for a in campaign_assets(spec):
            for k in a.keys:
                if k.path[0] == spec.name:
                    out[k.path[-1]] = {i.path[-1] for i in a.asset_deps[k]}
        return out

    skipped = stages(load_campaign_file(SHIPPED))
    assert not {"teacher_generations", "distillation_set", "tokenized_dataset"} & set(skipped)
    assert "prompts" in skipped["student_adapter"] and "tokenized_dataset" not in skipped["student_adapter"]
    assert "tokenized_dataset" not in skipped["campaign_cost"] and "student_adapter" in skipped["campaign_cost"]
    with_teacher = stages(
        load_campaign_file(
            _write(
                tmp_path,
                lambda d: _op(d).update(
                    {"teacher_generations": "generate", "warmup": "sequence_kd", "warmup_steps": 8}
                ),
            )
        )
    )
    assert {"teacher_generations", "distillation_set", "tokenized_dataset"} <= set(with_teacher)
    assert {"tokenized_dataset", "prompts"} <= with_teacher["student_adapter"]
    assert "teacher_generations" in with_teacher["campaign_cost"]


def test_adapter_keys_of_other_losses_are_unchanged():
    """The `on_policy` section is left out of the adapter key of every other loss (existing adapters keep theirs)."""
    from stages.student_adapter import training_key_fields

    for name in ("demo", "smollm2"):
        spec = load_campaign_file(REPO_ROOT / "campaigns" / f"{name}.yaml")
        assert "on_policy" not in training_key_fields(spec)["training"]["distillation"]
    assert training_key_fields(load_campaign_file(SHIPPED))["training"]["distillation"]["on_policy"]["lambda_"] == 1.0


def test_schedule_warmup_lambda_rounds_and_prompt_shares():
    from training.on_policy import Schedule

    s = Schedule(0.5, 10, seed=3, steps_per_round=4, prompts=50, samples_per_rank=8, world=2)
    assert not any(s.on_policy(i) for i in range(10))
    on = [i for i in range(10, 2010) if s.on_policy(i)]
    assert 0.45 < len(on) / 2000 < 0.55
    assert [s.round_of(i) for i in on[:6]] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert s.index(on[5]) == 5
    a, b = s.round_prompts(0, 0), s.round_prompts(0, 1)
    assert len(a) == len(b) == 8 and not set(a) & set(b)
    assert s.round_prompts(1, 0) != a  # the next round takes the next prompts
    full = Schedule(1.0, 0, seed=0, steps_per_round=2, prompts=5, samples_per_rank=4, world=1)
    assert all(full.on_policy(i) for i in range(20)) and full.round_of(5) == (2, 1)


def test_batch_labels_the_samples_and_aligns_the_teacher():
    from training import losses
    from training.on_policy import ScoredSample, batch

    s1 = ScoredSample(0, [1, 5, 6], [7, 2], [[7, 8], [2, 9]], [[-0.1, -2.5], [-0.2, -1.9]], 9)
    s2 = ScoredSample(1, [1, 4], [3], [[3, 7]], [[-0.3, -1.4]], 6)
    b = batch([s1, s2], pad_id=0, max_seq_len=64)
    assert b["input_ids"].tolist() == [[1, 5, 6, 7, 2, 1, 4, 3]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert b["labels"].tolist() == [[-100, -100, -100, 7, 2, -100, -100, 3]]
    ids = b[losses.TEACHER_IDS][0]
    assert ids[3].tolist() == [7, 8] and ids[4].tolist() == [2, 9] and ids[7].tolist() == [3, 7]
    assert (ids[[0, 1, 2, 5, 6]] == -1).all()
    assert b[losses.TEACHER_LOGPROBS][0, 4].tolist() == pytest.approx([-0.2, -1.9])


def test_teacher_prompt_gets_the_context_of_its_categories_only():
    from training.on_policy import teacher_prompt

    ctx = [{"role": "system", "content": "Be brief."}]
    assert teacher_prompt("Plural of cat?", "plural", ctx, ["plural"], chat=False) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Plural of cat?"},
    ]
    assert teacher_prompt("Capital of France?", "fact", ctx, ["plural"], chat=False) == "Capital of France?"
    assert teacher_prompt("x", None, (), None, chat=True) == [{"role": "user", "content": "x"}]


def test_an_unknown_key_lists_lambda_as_written_in_yaml(tmp_path):
    msg = _error(tmp_path, lambda d: _op(d).update({"betta": 1.0}))
    assert "training.distillation.on_policy.betta: unknown key; expected one of: lambda, beta," in msg, msg
