"""The gate in Dagster: the blocking check stops promotion in the run, promotion re-checks across
runs, and human review waits for an approval of that exact candidate.

The candidates are real but untrained LoRA adapters (B = 0, so they answer exactly like the
base); evaluation really loads the 4-bit student with and without them and generates."""

import json
import shutil

import pytest
import yaml
from dagster import AssetCheckEvaluation, AssetCheckKey, AssetCheckSeverity, DagsterInstance, materialize

from assets import demo_models
from assets.common import key
from assets.location import campaign_assets, default_resources
from assets.promoted_model import approve_job
from campaign_app.cli import main as cli_main
from campaigns.loader import load_campaign_file
from tests.support.eval_support import REPO_ROOT, heldout_rows, make_zero_adapter, seed_upstream

NAME = "gated"


def write_spec(tmp_path, min_score: float, review: bool):
    d = yaml.safe_load((REPO_ROOT / "campaigns/demo.yaml").read_text())
    d["name"] = NAME
    d.pop("schedule", None)
    d["evaluation"] = {
        "suites": [{"name": "cipher", "source": "heldout", "scorer": "exact_match", "max_new_tokens": 8}],
        "gate": {"min_score": min_score, "max_regression_vs_base": 0.03, "min_items": 20},
        "statistics": {"resamples": 2000},
        "evaluate_teacher": False,
        "requires_human_review": review,
    }
    p = tmp_path / f"{NAME}-{min_score}-{review}.yaml"
    p.write_text(yaml.safe_dump(d, allow_unicode=True))
    return load_campaign_file(p), p


def run(spec, root, instance, *stages):
    return materialize(
        campaign_assets(spec) + [demo_models.demo_models],
        selection=[key(spec, s) for s in stages],
        resources=default_resources(str(root)),
        instance=instance,
        raise_on_error=False,
    )


def latest(root, stage):
    p = root / NAME / stage / "LATEST.json"
    return json.loads(p.read_text()) if p.exists() else None


def last_observation(instance, asset_key):
    return instance.fetch_observations(asset_key, limit=1).records[0].asset_observation


def failure_message(result) -> str:
    return " ".join(e.event_specific_data.error.message for e in result.all_events if e.is_step_failure)


@pytest.fixture(scope="module")
def adapters(demo_models, tmp_path_factory):
    """Two different candidates (untrained LoRA of rank 4 and 8) for the demo student."""
    d = tmp_path_factory.mktemp("adapters")
    return {name: make_zero_adapter(demo_models["student"], d / name, r=r) for name, r in (("a", 4), ("b", 8))}


@pytest.fixture
def seeded(artifact_root, demo_models, adapters):
    cand = seed_upstream(artifact_root, NAME, heldout_rows(24), adapters["a"], demo_models["student"])
    return artifact_root, cand


def test_blocking_gate_stops_promotion_in_the_run_and_across_runs(seeded, tmp_path):
    root, cand = seeded
    instance = DagsterInstance.ephemeral()
    spec, _ = write_spec(tmp_path, min_score=0.8, review=False)  # the untrained candidate scores 0%: NO-GO
    result = run(spec, root, instance, "evaluation", "promoted_model")
    assert not result.success
    check = result.get_asset_check_evaluations()[0]
    assert check.check_name == "gate" and not check.passed and check.metadata["verdict"].value == "NO-GO"
    assert check.metadata["candidate_key"].value == cand["key"]
    # the check page shows each rule with what was measured, its threshold and its result, in percent
    assert check.metadata["cipher · min_score"].value == "0.0% · threshold ≥ 80.0% · BREACH"
    regression = check.metadata["cipher · max_regression_vs_base"].value
    assert regression == "+0.0 pts [+0.0, +0.0] · threshold CI low ≥ -3.0 pts · PASS", regression  # B = 0
    assert check.metadata["cipher"].value.startswith("NO-GO · candidate 0.0%, base 0.0%, candidate − base +0.0 pts")
    assert check.description.startswith("NO-GO: ") and "(not: cipher min_score)" in check.description
    first = {
        k: v.value
        for k, v in instance.get_latest_materialization_event(
            key(spec, "evaluation")
        ).asset_materialization.metadata.items()
    }
    assert first["reused"] is False and first["time"].endswith(" s") and "answers" in first
    promo = [e.event_type_value for e in result.all_events if e.step_key == f"{NAME}__promoted_model"]
    assert "STEP_START" not in promo and "STEP_SUCCESS" not in promo  # never ran
    assert instance.get_latest_materialization_event(key(spec, "promoted_model")) is None
    ev = latest(root, "evaluation")
    assert ev["verdict"] == "NO-GO" and any(r.startswith("cipher: min_score: BREACH") for r in ev["reasons"])
    md = instance.get_latest_materialization_event(key(spec, "evaluation")).asset_materialization.metadata
    assert "| cipher | **all** | 24 |" in md["report"].value

    # a later run that asks for promotion alone is refused too
    again = run(spec, root, instance, "promoted_model")
    assert not again.success and "gate verdict for candidate" in failure_message(again)

    # a GO policy re-judges the stored answers (no new generation) and promotes
    go, _ = write_spec(tmp_path, min_score=0.0, review=False)
    ok = run(go, root, instance, "evaluation", "promoted_model")
    assert ok.success and latest(root, "evaluation")["items_key"] == ev["items_key"]
    # a new judgement of stored answers: not reused, and it claims none of the answering as this run's work
    rejudged = {k: v.value for k, v in ok.asset_materializations_for_node(f"{NAME}__evaluation")[-1].metadata.items()}
    assert rejudged["reused"] is False and rejudged["time"].startswith("re-judged stored answers (they took ")
    assert not {"answers", "ray_shards", "lm_eval_seconds"} & rejudged.keys(), rejudged
    assert latest(root, "promoted_model")["candidate_key"] == cand["key"]

    # the instance's latest gate check failing (e.g. re-run elsewhere) blocks promotion across runs
    instance.report_runless_asset_event(
        AssetCheckEvaluation(
            asset_key=key(go, "evaluation"),
            check_name="gate",
            passed=False,
            severity=AssetCheckSeverity.ERROR,
            metadata={"candidate_key": cand["key"], "verdict": "NO-GO"},
        )
    )
    refused = run(go, root, instance, "promoted_model")
    assert not refused.success and "latest `gate` check" in failure_message(refused)
    assert instance.get_latest_asset_check_evaluation_record(AssetCheckKey(key(go, "evaluation"), "gate")) is not None


def test_human_review_waits_for_an_approval_of_that_exact_candidate(
    seeded, tmp_path, demo_models, adapters, monkeypatch
):
    root, cand_a = seeded
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    instance = DagsterInstance.ephemeral()
    spec, spec_file = write_spec(tmp_path, min_score=0.0, review=True)
    resources = {"storage": default_resources(str(root))["storage"]}

    first = run(spec, root, instance, "evaluation", "promoted_model")
    assert first.success and latest(root, "evaluation")["verdict"] == "GO"
    assert latest(root, "promoted_model") is None  # waiting, not promoted
    waiting = last_observation(instance, key(spec, "promoted_model"))
    assert waiting.metadata["status"].value == "awaiting human review"
    report = json.loads(open(latest(root, "evaluation")["gate_path"]).read())["markdown"]
    assert f"campaign approve {NAME} --candidate {cand_a['key']}" in report

    approve = approve_job(spec)
    wrong = approve.execute_in_process(
        run_config={
            "ops": {f"{NAME}_approve_candidate": {"config": {"candidate_key": "not-it", "approved_by": "alice"}}}
        },
        instance=instance,
        resources=resources,
        raise_on_error=False,
    )
    assert not wrong.success and "not the latest evaluated candidate" in failure_message(wrong)
    given = approve.execute_in_process(
        run_config={
            "ops": {
                f"{NAME}_approve_candidate": {
                    "config": {"candidate_key": cand_a["key"], "approved_by": "alice", "note": "read it"}
                }
            }
        },
        instance=instance,
        resources=resources,
    )
    assert given.success
    seen = last_observation(instance, key(spec, "evaluation"))
    assert seen.metadata["approved_by"].value == "alice" and seen.metadata["approved_candidate"].value == cand_a["key"]

    promoted = run(spec, root, instance, "promoted_model")
    assert promoted.success
    record = latest(root, "promoted_model")
    assert record["candidate_key"] == cand_a["key"] and record["approval"]["approved_by"] == "alice"
    assert record["approval"]["approved_at"].endswith("Z")

    # a later candidate needs its own approval: alice's is not reused, not even copied under its name
    cand_b = seed_upstream(root, NAME, heldout_rows(24), adapters["b"], demo_models["student"])
    assert cand_b["key"] != cand_a["key"]
    later = run(spec, root, instance, "evaluation", "promoted_model")
    assert later.success and latest(root, "promoted_model")["candidate_key"] == cand_a["key"]
    approvals = root / NAME / "approvals"
    shutil.copy(approvals / f"{cand_a['key']}.json", approvals / f"{cand_b['key']}.json")
    still = run(spec, root, instance, "promoted_model")
    assert still.success and latest(root, "promoted_model")["candidate_key"] == cand_a["key"]

    # approved from the CLI (who and when stored), then promoted
    (approvals / f"{cand_b['key']}.json").unlink()
    assert (
        cli_main(["approve", str(spec_file), "--candidate", cand_a["key"], "--by", "bob", "--artifacts", str(root)])
        == 1
    )  # not the latest candidate any more
    assert (
        cli_main(["approve", str(spec_file), "--candidate", cand_b["key"], "--by", "bob", "--artifacts", str(root)])
        == 0
    )
    stored = json.loads((approvals / f"{cand_b['key']}.json").read_text())
    assert stored["approved_by"] == "bob" and stored["via"] == "cli" and stored["approved_at"]
    final = run(spec, root, instance, "promoted_model")
    assert final.success and latest(root, "promoted_model")["candidate_key"] == cand_b["key"]
    assert latest(root, "promoted_model")["approval"]["approved_by"] == "bob"


def test_an_approval_needs_a_go_gate_and_matches_one_evaluation(tmp_path):
    from evaluation.approval import ApprovalError, find_approval, record_approval

    ev = {"key": "e1", "candidate_key": "c1", "verdict": "NO-GO"}
    with pytest.raises(ApprovalError, match="gate verdict NO-GO"):
        record_approval(NAME, tmp_path, ev, "c1", "alice")
    ev["verdict"] = "GO"
    with pytest.raises(ApprovalError, match="reviewer's name"):
        record_approval(NAME, tmp_path, ev, "c1", " ")
    a, created = record_approval(NAME, tmp_path, ev, "c1", "alice")
    assert created and record_approval(NAME, tmp_path, ev, "c1", "bob") == (a, False)
    assert find_approval(tmp_path, "c1", "e1") == a
    assert find_approval(tmp_path, "c1", "e2") is None  # the same adapter judged under another gate policy
