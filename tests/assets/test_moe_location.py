"""The MoE campaign in the code location: its student model is its own demo asset, its job resolves
(the teacher/student multi-asset is subset), settings the model refuses stop the stage before launch,
and a MoE training summary becomes the asset's by-kind metadata."""

import pytest
from dagster import AssetKey

from assets.location import build_definitions, campaign_job_name
from assets.student_adapter import moe_metadata
from campaigns.loader import load_campaign_file
from stages.student_adapter import refuse_before_launch
from tests.support import REPO_ROOT as REPO


def test_moe_campaign_depends_on_the_moe_student_asset_and_its_job_resolves():
    defs = build_definitions([str(REPO / "campaigns" / "demo_moe.yaml")])
    graph = defs.resolve_asset_graph()
    node = graph.get(AssetKey(["demo_moe", "student_adapter"]))
    assert AssetKey(["demo_models", "moe_student"]) in node.parent_keys
    assert AssetKey(["demo_models", "student"]) not in node.parent_keys
    job = defs.resolve_job_def(campaign_job_name("demo_moe"))  # the teacher alone out of the demo_models multi-asset
    assert {"demo_models", "demo_models__moe_student"} <= {n.name for n in job.nodes}


def test_settings_the_moe_student_refuses_stop_the_stage_before_launch(tmp_path):
    import yaml

    from tests.support.moe_support import write_moe_config

    write_moe_config(tmp_path / "moe")
    data = yaml.safe_load((REPO / "campaigns" / "demo_moe.yaml").read_text())
    data["student"]["lora"]["target_parameters"] = []
    path = tmp_path / "campaigns" / "m.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data))
    spec = load_campaign_file(path)
    with pytest.raises(
        ValueError,
        match=r"refuses these settings, nothing was launched:\n  student.lora: the model "
        r"has 4 routed experts",
    ):
        refuse_before_launch(spec, tmp_path / "moe")
    refuse_before_launch(load_campaign_file(REPO / "campaigns" / "demo_moe.yaml"), tmp_path / "moe")


def test_moe_summary_becomes_metadata_by_kind():
    moe = {
        "trainable_by_kind": {"attention": 8192, "dense_mlp": 0, "routed_experts": 17408, "router": 512, "other": 0},
        "parameters_by_kind": {"attention": 32832},
        "routed_experts_trained": True,
        "experts_quantized": False,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "expert_rank": 8,
        "router": "trained",
        "aux_loss_coef": 0.001,
        "expert_lora_b_nonzero": 16,
        "expert_lora_b_slices": 16,
        "routed_tokens_per_expert": {"layer_0": [1, 2, 3, 4]},
        "expert_grad_checks": [],
        "routing_collapse_warnings": [],
    }
    md = moe_metadata(moe)
    assert (md["trainable_routed_experts"], md["trainable_attention"], md["trainable_router"]) == (17408, 8192, 512)
    assert md["expert_lora_b_nonzero"] == "16/16" and md["routed_experts_trained"] is True
    assert md["routed_tokens_per_expert"].data == {"layer_0": [1, 2, 3, 4]}
    assert moe_metadata(None) == {}


def test_adapter_keys_of_dense_campaigns_did_not_change_with_the_moe_fields():
    """The new student fields at their defaults stay out of the adapter's key: no cached adapter is retrained
    and no model-change sensor fires because the spec grew."""
    from stages.student_adapter import training_key_fields

    dense = training_key_fields(load_campaign_file(REPO / "campaigns" / "demo.yaml"))["student"]
    assert "moe" not in dense and {"target_parameters", "use_dora"}.isdisjoint(dense["lora"])
    moe = training_key_fields(load_campaign_file(REPO / "campaigns" / "demo_moe.yaml"))["student"]
    assert moe["moe"]["router"] == "trained" and moe["lora"]["target_parameters"]
