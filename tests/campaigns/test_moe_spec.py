"""The student's mixture-of-experts fields: what PEFT refuses is refused when the file is validated,
naming file, line and field (PEFT's own reason quoted), and the shipped MoE campaign is valid."""

import pytest
import yaml

from campaigns.loader import CampaignError, load_campaigns, parse_campaign_text
from campaigns.spec import PARAM_WRAPPER_REFUSES
from tests.support import REPO_ROOT as REPO

MOE = (REPO / "campaigns" / "demo_moe.yaml").read_text()


def _problems(text: str) -> str:
    with pytest.raises(CampaignError) as e:
        parse_campaign_text(text, "campaigns/bad.yaml")
    return str(e.value)


def _with(**lora) -> str:
    data = yaml.safe_load(MOE)
    data["student"]["lora"].update(lora)
    return yaml.safe_dump(data, sort_keys=False)


def test_the_shipped_moe_campaign_targets_the_routed_experts():
    spec = load_campaigns([str(REPO / "campaigns" / "demo_moe.yaml")]).campaigns["demo_moe"]
    s = spec.student
    assert s.base_model == "@demo/moe_student" and s.lora.dropout == 0.0
    assert s.lora.target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert (s.moe.experts, s.moe.router, s.moe.aux_loss_coef) == ("trained", "trained", 0.001)
    assert spec.teacher.model == "@demo/teacher"


@pytest.mark.parametrize("field,value,fix", [("dropout", 0.05, "dropout: 0"), ("use_dora", True, "use_dora: false")])
def test_what_peft_refuses_on_expert_parameters_is_refused_at_validation(field, value, fix):
    msg = _problems(_with(**{field: value}))
    line = next(i for i, t in enumerate(_with(**{field: value}).splitlines(), 1) if t.strip().startswith("lora:"))
    assert f"campaigns/bad.yaml:{line}: student.lora:" in msg
    assert PARAM_WRAPPER_REFUSES[field] in msg and fix in msg


def test_dropout_and_dora_stay_allowed_without_expert_parameters():
    ok = parse_campaign_text(_with(dropout=0.1, use_dora=True, target_parameters=[]))
    assert ok.student.lora.dropout == 0.1 and ok.student.lora.use_dora


def test_dora_on_more_than_one_process_is_refused():
    data = yaml.safe_load(_with(use_dora=True, target_parameters=[]))
    data["training"]["processes_per_node"] = 2
    msg = _problems(yaml.safe_dump(data))
    assert "student.lora.use_dora with training.nodes × processes_per_node = 2" in msg and "FSDP2" in msg


@pytest.mark.parametrize(
    "moe,needle",
    [
        ({"experts": "sometimes"}, "student.moe.experts"),
        ({"expert_rank": 2}, "student.moe.expert_rank"),
        ({"aux_loss_coef": -1}, "student.moe.aux_loss_coef"),
        ({"colapse_share": 0.5}, "unknown key; expected one of: experts, expert_rank"),
    ],
)
def test_bad_moe_fields_name_the_field(moe, needle):
    data = yaml.safe_load(MOE)
    data["student"]["moe"] = moe
    assert needle in _problems(yaml.safe_dump(data))
