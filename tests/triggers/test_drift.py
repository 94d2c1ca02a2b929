"""Drift: the scheduled re-evaluation of the promoted model and the retraining request.

The drift evaluation really runs: the promoted adapter (a real, untrained LoRA adapter on the
demo student, which only copies words) answers the freshest held-out items of the cipher task,
scores far below the gate floor and below its recorded promotion-time score, and the
``<campaign>_drift_retrain`` sensor requests a retraining run with the reason in its tags.
With a prompt file added after the promotion, the items are that file's held-out rows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from dagster import (
    AssetKey,
    AssetMaterialization,
    DagsterInstance,
    build_schedule_context,
    build_sensor_context,
    materialize,
)

from assets import prompts
from assets.common import STAGES
from assets.location import build_definitions, default_resources
from evaluation.drift import DRIFTED, INCONCLUSIVE, STABLE, decide
from campaigns.loader import load_campaign_file
from campaign_orchestrator.dataset import prompts as P
from resources.storage import ArtifactStore
from campaign_orchestrator.demo import cipher

from tests.support import REPO_ROOT as REPO


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


def test_fresh_heldout_prefers_prompts_the_model_never_saw():
    def rows(items, name):
        return [r | {"source_file": name} for r in items]

    # At promotion: a.jsonl, split with the cap (some hash-held-out items went to train).
    a = rows(cipher.items(160, seed=5), "a.jsonl")
    train, held = P.split(a, 0.25, 0, max_items=30)
    capped = {r["id"] for r in train if P.is_heldout(r["id"], 0.25, 0)}
    assert capped
    seen, seen_held = {r["id"] for r in a}, {r["id"] for r in held}
    b = rows(cipher.items(200, seed=6, id_prefix="q"), "b.jsonl")
    b_held = [r["id"] for r in b if P.is_heldout(r["id"], 0.25, 0)]
    assert len(b_held) > 30
    # The normal split of everything keeps old items in hash order: a.jsonl gets in too.
    assert any(r["source_file"] == "a.jsonl" for r in P.split(a + b, 0.25, 0, max_items=30)[1])

    newest = ["b.jsonl", "a.jsonl"]
    fresh, earlier = P.fresh_heldout(a + b, 0.25, 0, seen, seen_held, newest, max_items=30, min_items=20)
    assert len(fresh) == 30 and {r["id"] for r in fresh} <= set(b_held) and earlier == []

    # Too few fresh items: topped up to min_items with the promotion-time held-out items only.
    few = rows(cipher.items(12, seed=6, id_prefix="q"), "b.jsonl")
    fresh, earlier = P.fresh_heldout(a + few, 0.25, 0, seen, seen_held, newest, max_items=30, min_items=20)
    assert {r["id"] for r in fresh} == {r["id"] for r in few if P.is_heldout(r["id"], 0.25, 0)}
    assert len(fresh) + len(earlier) == 20 and {r["id"] for r in earlier} <= seen_held
    assert not {r["id"] for r in fresh + earlier} & capped


def _campaign(tmp_path: Path, max_items: int | None = None) -> Path:
    spec = yaml.safe_load((REPO / "campaigns" / "demo.yaml").read_text())
    spec["name"] = "drifty"
    cipher.write_jsonl(cipher.items(160, seed=5), tmp_path / "drops" / "a.jsonl")
    spec["data"]["source"] = str(tmp_path / "drops" / "*.jsonl")
    spec["data"]["heldout"] = {"fraction": 0.25, "seed": 0, "max_items": max_items}
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
        "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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
        # No prompts stage from before the promotion here: what it saw is unknown, the current split is used.
        assert md["fresh_items"] is None and "unknown" in md["item_selection"]["summary"]

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


@pytest.mark.slow
def test_drift_scores_the_held_out_items_of_prompts_added_after_the_promotion(tmp_path, artifact_root, demo_models):
    path = _campaign(tmp_path, max_items=30)
    spec, resources = load_campaign_file(path), default_resources(str(artifact_root))
    # The promoted model's data: a.jsonl, split by the real prompts asset before the promotion.
    before = materialize([prompts.build(spec)], resources=resources).asset_value(AssetKey(["drifty", "prompts"]))
    key = _promote_untrained_adapter(artifact_root, demo_models["student"], promoted_score=0.97)
    time.sleep(1.1)  # promoted_at has whole seconds: the next prompts stage is committed after it
    # A drop after the promotion; a new-data run splits it too, but its model is not promoted.
    late = cipher.items(200, seed=6, id_prefix="q")
    cipher.write_jsonl(late, tmp_path / "drops" / "b.jsonl")
    after = materialize([prompts.build(spec)], resources=resources).asset_value(AssetKey(["drifty", "prompts"]))
    assert after["key"] != before["key"]

    defs = build_definitions([str(path)], artifact_root=str(artifact_root))
    with DagsterInstance.ephemeral() as instance:
        result = defs.resolve_job_def("drifty_drift_check").execute_in_process(instance=instance)
    assert result.success
    (mat,) = result.asset_materializations_for_node("drifty__drift_evaluation")
    md = {k: v.value for k, v in mat.metadata.items()}
    assert md["promoted_key"] == key and md["verdict"] == "DRIFTED"

    # Scored: b.jsonl's held-out items (hash rule, capped at max_items), none of a.jsonl's.
    fresh = sorted((r for r in late if P.is_heldout(r["id"], 0.25, 0)), key=lambda r: P._hash_order(r, 0))[:30]
    scored = set(pq.read_table(Path(md["path"]) / "items.parquet", columns=["item_id"]).column("item_id").to_pylist())
    assert scored == {r["id"] for r in fresh} and len(fresh) == 30
    trained = set(pq.read_table(before["train_path"], columns=["id"]).column("id").to_pylist())
    assert not scored & trained
    # The selection is recorded: which files, how many fresh items, from which promotion-time data.
    sel = md["item_selection"]
    assert sel["fresh_items"] == md["fresh_items"] == 30 and sel["earlier_items"] == md["earlier_items"] == 0
    assert sel["promotion_prompts"] == [before["key"]] and "from b.jsonl" in sel["summary"]
    files = {f["name"]: f for f in sel["files"]}
    assert files["b.jsonl"] | {"sha256": None} == {"name": "b.jsonl", "sha256": None, "rows": 200, "new_rows": 200,
                                                   "items": 30, "fresh_items": 30, "earlier_items": 0}
    assert files["a.jsonl"]["new_rows"] == 0 and files["a.jsonl"]["items"] == 0
    assert sel == json.loads((Path(md["path"]) / "drift.json").read_text())["item_selection"]
