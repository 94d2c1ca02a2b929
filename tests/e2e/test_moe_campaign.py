"""End to end through Dagster on a shrunken copy of campaigns/demo_moe.yaml: the cipher teacher distilled
into the MoE student (LoRA on attention and routed experts, router trained) beats the MoE base at the
gate, and the student_adapter metadata shows the routed experts trained, by kind and by expert."""

import pytest
import yaml
from dagster import AssetKey, DagsterInstance

from assets.location import build_definitions, campaign_job_name
from campaign_orchestrator.demo import cipher
from tests.support import REPO_ROOT as REPO

pytestmark = pytest.mark.slow


def _metadata(result, key: AssetKey) -> dict:
    mats = list(result.asset_materializations_for_node(key.to_python_identifier()))
    assert mats, f"no materialization of {key.to_user_string()}"
    return {k: v.value for k, v in mats[-1].metadata.items()}


def test_moe_campaign_trains_the_routed_experts_and_beats_the_moe_base(tmp_path, moe_student, artifact_root):
    spec = yaml.safe_load((REPO / "campaigns" / "demo_moe.yaml").read_text())
    data = tmp_path / "data" / "prompts.jsonl"
    cipher.write_jsonl(cipher.items(700, seed=99), data)
    spec.update(name="mini_moe")
    spec["data"]["source"] = str(data)
    spec["data"]["heldout"] = {"fraction": 0.12, "seed": 0}
    spec["training"].update({"max_steps": 80, "log_every": 10})
    spec["evaluation"]["gate"]["min_items"] = 40
    path = tmp_path / "mini_moe.yaml"
    path.write_text(yaml.safe_dump(spec))

    defs = build_definitions([str(path)], artifact_root=str(artifact_root))
    result = defs.resolve_job_def(campaign_job_name("mini_moe")).execute_in_process(
        instance=DagsterInstance.ephemeral(), raise_on_error=False
    )
    assert result.success
    ev = _metadata(result, AssetKey(["mini_moe", "evaluation"]))
    assert ev["verdict"] == "GO"
    assert ev["cipher_base_score"] <= 0.2 and ev["cipher_candidate_score"] >= 0.8
    assert ev["cipher_candidate_score"] > ev["cipher_base_score"] + 0.5
    train = _metadata(result, AssetKey(["mini_moe", "student_adapter"]))
    assert train["routed_experts_trained"] is True and train["experts_quantized"] is False
    assert train["trainable_routed_experts"] == 2 * 8 * 4 * (2 * 64 + 3 * 48)  # L · r · E · (2H + 3I)
    assert train["trainable_attention"] == 2 * 8 * 4 * 128 and train["trainable_router"] == 2 * 4 * 64
    assert train["trainable_dense_mlp"] == 0
    assert train["trainable_parameters"] == 8192 + 17408 + 512
    assert train["expert_lora_b_nonzero"] == "16/16"
    routed = train["routed_tokens_per_expert"]
    assert set(routed) == {"layer_0", "layer_1"} and all(len(v) == 4 and min(v) > 0 for v in routed.values())
    assert sum(routed["layer_0"]) == 2 * train["tokens"]  # every real token, top-2
    assert [c["lora"] for c in train["expert_grad_checks"]] == ["B", "A"]
    assert train["final_loss"] < train["first_loss"] / 5
    print(
        "mini_moe:",
        {k: ev[k] for k in ("cipher_base_score", "cipher_candidate_score", "verdict")},
        {k: train[k] for k in ("trainable_breakdown", "routed_tokens_per_expert", "first_loss", "final_loss")},
    )
