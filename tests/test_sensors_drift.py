"""Drift: the scheduled re-evaluation of the promoted model and the retraining request.

The drift evaluation really runs: the promoted adapter (a real, untrained LoRA adapter on the
demo student, which only copies words) answers the freshest held-out items of the cipher task,
scores far below the gate floor and below its recorded promotion-time score, and the
``<campaign>_drift_retrain`` sensor requests a retraining run with the reason in its tags.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, AssetMaterialization, DagsterInstance, build_schedule_context, build_sensor_context

from assets.common import STAGES
from assets.location import build_definitions
from automation.drift import DRIFTED, INCONCLUSIVE, STABLE, decide
from resources.storage import ArtifactStore
from tinymodels import cipher

REPO = Path(__file__).resolve().parent.parent


def test_decide_floor_drop_and_evidence():
    below = decide({"s": (0.5, 40)}, {"s": 0.55}, floor=0.8, max_drop=0.1, min_items=20)
    assert below.verdict == DRIFTED and "below the gate floor 0.800" in below.reasons[0]
    dropped = decide({"s": (0.85, 40)}, {"s": 0.97}, floor=0.8, max_drop=0.05, min_items=20)
    assert dropped.verdict == DRIFTED and "dropped 0.120 from its promotion-time score 0.970" in dropped.summary()
    assert decide({"s": (0.95, 40)}, {"s": 0.97}, floor=0.8, max_drop=0.05, min_items=20).verdict == STABLE
    few = decide({"s": (0.1, 5)}, {"s": 0.97}, floor=0.8, max_drop=0.05, min_items=20)
    assert few.verdict == INCONCLUSIVE and "fewer than the gate's min_items 20" in few.summary()
    # No promotion-time score for a suite: only the floor applies.
    assert decide({"new": (0.9, 40)}, {}, floor=0.8, max_drop=0.0, min_items=20).verdict == STABLE


def _campaign(tmp_path: Path) -> Path:
    spec = yaml.safe_load((REPO / "campaigns" / "demo.yaml").read_text())
    spec["name"] = "drifty"
    spec["data"]["source"] = str(cipher.write_jsonl(cipher.items(160, seed=5), tmp_path / "drops" / "a.jsonl"))
    spec["data"]["heldout"] = {"fraction": 0.25, "seed": 0}
    spec["evaluation"]["gate"]["min_items"] = 20
    spec["automation"] = {"drift": {"enabled": True, "cron": "15 4 * * *", "max_drop": 0.05}}
    path = tmp_path / "drifty.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _promote_untrained_adapter(artifact_root: Path, student: Path, promoted_score: float) -> str:
    """A real LoRA adapter (PEFT initializes B to zero, so it answers like the base) published the
    way promoted_model publishes one, with the score it is said to have had at promotion."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    key = "untrained0000000000"
    dest = artifact_root / "drifty" / "promoted_model" / key
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(student),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(dest / "adapter")
    (dest / "promotion.json").write_text(json.dumps({
        "candidate_key": key, "base_model_path": str(student), "verdict": "GO",
        "scores": {"candidate": {"cipher": promoted_score}, "base": {"cipher": 0.0}}}))
    (dest.parent / "CURRENT").write_text(key)
    return key


@pytest.mark.slow
def test_drift_below_the_floor_requests_a_retraining_run(tmp_path, artifact_root, demo_models):
    defs = build_definitions([str(_campaign(tmp_path))], artifact_root=str(artifact_root))
    schedule = defs.resolve_schedule_def("drifty_drift")
    assert schedule.cron_schedule == "15 4 * * *"
    storage = {"storage": ArtifactStore(root=str(artifact_root))}
    with DagsterInstance.ephemeral() as instance:
        nothing = schedule.evaluate_tick(build_schedule_context(instance=instance, resources=storage))
        assert not nothing.run_requests and "no promoted model yet" in nothing.skip_message

        key = _promote_untrained_adapter(artifact_root, demo_models["student"], promoted_score=0.97)
        tick = schedule.evaluate_tick(build_schedule_context(instance=instance, resources=storage))
        (check,) = tick.run_requests
        assert check.tags["trigger"] == "schedule" and key in check.tags["trigger_reason"]

        # The drift check runs for real: base + adapter answer the fresh held-out items.
        result = defs.resolve_job_def("drifty_drift_check").execute_in_process(instance=instance, tags=check.tags)
        assert result.success
        (mat,) = result.asset_materializations_for_node("drifty__drift_evaluation")
        md = {k: v.value for k, v in mat.metadata.items()}
        assert md["verdict"] == "DRIFTED" and md["drifted"] is True
        assert md["heldout_items"] >= 20 and md["cipher_fresh_score"] < 0.2
        assert "below the gate floor 0.800" in md["summary"] and "promotion-time score 0.970" in md["summary"]

        sensor = defs.resolve_sensor_def("drifty_drift_retrain")
        data = sensor.evaluate_tick(build_sensor_context(instance=instance, definitions=defs))
        (req,) = data.run_requests
        assert req.tags["trigger"] == "drift" and req.tags["drifted_model"] == key
        assert "below the gate floor" in req.tags["trigger_reason"] and req.tags["drift_run"] == result.run_id
        assert set(req.asset_selection) == {AssetKey(["drifty", s]) for s in STAGES}
        assert req.run_key == f"drift-{md['drift_key']}"

        # A STABLE re-evaluation requests nothing.
        instance.report_runless_asset_event(AssetMaterialization(
            AssetKey(["drifty", "drift_evaluation"]), metadata={"verdict": "STABLE", "promoted_key": key, "summary": "ok"}))
        stable = sensor.evaluate_tick(build_sensor_context(instance=instance, definitions=defs, cursor=data.cursor))
        assert not stable.run_requests and "STABLE" in stable.skip_message
