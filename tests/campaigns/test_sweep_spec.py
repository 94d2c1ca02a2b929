"""The `sweep:` section: the shipped example is valid; bad sweeps get errors naming the field (campaign validate)."""

import pytest
import yaml

from campaign_app import cli
from campaigns.loader import CampaignError, parse_campaign_text
from tests.support import REPO_ROOT as REPO

SWEEP = (REPO / "campaigns" / "demo_sweep.yaml").read_text()


def _with(mutate) -> str:
    data = yaml.safe_load(SWEEP)
    mutate(data)
    return yaml.safe_dump(data, sort_keys=False)


def _problems(text: str) -> str:
    with pytest.raises(CampaignError) as e:
        parse_campaign_text(text, "campaigns/bad.yaml")
    return str(e.value)


def test_shipped_sweep_campaign_is_valid_and_its_ladder_ends_at_max_steps():
    spec = parse_campaign_text(SWEEP, "campaigns/demo_sweep.yaml")
    sw = spec.sweep
    assert sw.ladder(spec.training.max_steps) == [30, 90, 270] == [30, 90, spec.training.max_steps]
    assert set(sw.space) == {"training.learning_rate", "student.lora.r"}
    best = spec.with_params({"training.learning_rate": 0.05, "student.lora.r": 16})
    assert (best.training.learning_rate, best.student.lora.r) == (0.05, 16)
    assert spec.training.learning_rate == 1e-2  # with_params returns a copy


@pytest.mark.parametrize(
    "mutate, says",
    [
        (
            lambda d: d["sweep"]["space"].update({"training.learnin_rate": {"type": "uniform", "low": 0, "high": 1}}),
            "sweep.space.training.learnin_rate: unknown field",
        ),
        (
            lambda d: d["sweep"]["space"].update({"teacher.model": {"type": "categorical", "choices": ["a"]}}),
            "sweep.space.teacher.model: unknown field",
        ),
        (
            lambda d: d["sweep"]["space"].update({"training.max_steps": {"type": "int", "low": 10, "high": 20}}),
            "sweep.space.training.max_steps: not sweepable",
        ),
        (
            lambda d: d["sweep"]["rungs"].update({"min_steps": 300}),
            "sweep.rungs.min_steps (300) must be below training.max_steps (270)",
        ),
        (
            lambda d: d["sweep"]["space"]["training.learning_rate"].update({"high": 5.0}),
            "sweep.space.training.learning_rate: the campaign refuses {'training.learning_rate': 5.0}",
        ),
        (
            lambda d: d["sweep"]["space"]["training.learning_rate"].update({"low": 0.0}),
            "a log-scale parameter needs low > 0",
        ),
        (
            lambda d: d["sweep"]["space"].update({"student.lora.r": {"type": "categorical"}}),
            "a categorical parameter takes `choices`",
        ),
        (lambda d: d["sweep"]["enqueue"].append({"student.lora.alpha": 4}), "not in sweep.space"),
    ],
)
def test_invalid_sweeps_name_the_field(mutate, says):
    msg = _problems(_with(mutate))
    assert "campaigns/bad.yaml" in msg and says in msg, msg


def test_validate_refuses_a_cap_below_one_rung(tmp_path, capsys):
    path = tmp_path / "campaigns" / "tiny_cap.yaml"
    path.parent.mkdir()
    (path.parent / "data").symlink_to(REPO / "campaigns" / "data")  # validate looks for the data it names
    path.write_text(_with(lambda d: d["sweep"].update({"budget_usd": 1e-5})).replace("demo_sweep", "tiny_cap"))
    assert cli.main(["validate", str(path)]) == cli.EXIT_INVALID
    out = capsys.readouterr().out
    assert "sweep.budget_usd $1e-05 is below the cost of one rung" in out and "cpu-2vcpu" in out
    path.write_text(SWEEP.replace("demo_sweep", "tiny_cap"))
    assert cli.main(["validate", str(path)]) == cli.EXIT_OK
