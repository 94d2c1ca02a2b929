"""End to end through Dagster on a shrunken demo: the student beats its base and is promoted; a
re-run is a no-op; the broken campaign is blocked by the gate and never promoted."""

import json
from pathlib import Path

import pytest
import yaml
from dagster import AssetCheckKey, AssetKey, DagsterEventType, DagsterInstance

from assets.location import build_definitions, campaign_job_name
from assets.run_recovery import LEASE_TAG
from campaign_orchestrator.costs.report import dollars, seconds
from campaign_orchestrator.demo import cipher
from resources.run_owner import OWNER_TAG
from stages.common import usd
from tests.support import REPO_ROOT as REPO

pytestmark = pytest.mark.slow


def _campaign(tmp_path: Path, name: str, harness: bool = False, **training) -> Path:
    """The demo, shrunken; ``harness``: keep its lm_eval suite (the tests of other stages leave it out)."""
    spec = yaml.safe_load((REPO / "campaigns" / "demo.yaml").read_text())
    if not harness:
        spec["evaluation"]["suites"] = [s for s in spec["evaluation"]["suites"] if s.get("kind") != "lm_eval"]
    data = tmp_path / "data" / "prompts.jsonl"
    if not data.exists():
        cipher.write_jsonl(cipher.items(700, seed=99), data)
    spec["name"] = name
    spec.pop("schedule", None)
    spec["data"]["source"] = str(data)
    spec["data"]["heldout"] = {"fraction": 0.12, "seed": 0}
    spec["training"].update({"max_steps": 70, "log_every": 10, **training})
    spec["evaluation"]["gate"]["min_items"] = 40
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _metadata(result, key: AssetKey) -> dict:
    mats = [m for m in result.asset_materializations_for_node(key.to_python_identifier())]
    assert mats, f"no materialization of {key.to_user_string()}"
    return {k: v.value for k, v in mats[-1].metadata.items()}


def test_demo_campaign_distils_and_promotes(tmp_path, artifact_root, recwarn):
    from campaign_orchestrator.content import UnresolvedKeyWarning

    path = _campaign(tmp_path, "mini", harness=True)
    defs = build_definitions([str(path)], artifact_root=str(artifact_root))
    job = defs.resolve_job_def(campaign_job_name("mini"))
    instance = DagsterInstance.ephemeral()
    result = job.execute_in_process(instance=instance, raise_on_error=False)
    assert result.success
    # no stage key of the demo holds `auto` (campaign_orchestrator.content.stage_key names any it sees)
    assert not [str(w.message) for w in recwarn if issubclass(w.category, UnresolvedKeyWarning)]
    ev = _metadata(result, AssetKey(["mini", "evaluation"]))
    assert ev["verdict"] == "GO"
    assert ev["cipher_base_score"] <= 0.2
    assert ev["cipher_candidate_score"] >= 0.8
    assert ev["cipher_candidate_score"] > ev["cipher_base_score"] + 0.5
    assert ev["cipher_teacher_score"] >= 0.9
    # the lm_eval suite (the shipped cipher tasks through lm-evaluation-harness) gates too, paired, and is priced
    assert ev["harness_cipher_base_score"] == 0.0 and ev["harness_cipher_candidate_score"] >= 0.8
    assert "harness_cipher_teacher_score" not in ev  # the teacher is scored on the project's suites only
    man = json.loads((artifact_root / "mini" / "evaluation" / "LATEST.json").read_text())  # the raw figures
    assert 0 < man["lm_eval_seconds"] < man["wall_seconds"] and 0 < man["lm_eval_usd"] < usd(man["cost_lines"])
    assert ev["lm_eval_seconds"] == seconds(man["lm_eval_seconds"]) and ev["lm_eval_usd"] == dollars(man["lm_eval_usd"])
    assert "| harness_cipher | cipher_gen | candidate | exact_match | 60 |" in ev["report"]
    dist = _metadata(result, AssetKey(["mini", "distillation_set"]))
    assert dist["decontamination"]["suites"]["harness_cipher/cipher_mc"]["documents_checked"] == 60
    assert dist["dropped_contaminated"] == dist["contaminated_rows"]
    train = _metadata(result, AssetKey(["mini", "student_adapter"]))
    assert train["final_loss"] < train["first_loss"] / 5
    current = artifact_root / "mini" / "promoted_model" / "CURRENT"
    assert current.exists()
    # the candidate's per-item scores travel with it: drift compares fresh scores with these
    assert (current.parent / current.read_text() / "promotion_items.parquet").exists()
    _the_promoted_folder_is_portable(current.parent / current.read_text(), ev, artifact_root, tmp_path, train)
    checks = [e for e in result.get_asset_check_evaluations() if e.check_name == "gate"]
    assert checks and checks[-1].passed
    assert [e.passed for e in result.get_asset_check_evaluations() if e.check_name == "decontamination"] == [True]
    cost = _metadata(result, AssetKey(["mini", "campaign_cost"]))
    assert cost["total_usd"] > 0 and cost["usd_per_point_gained"] > 0

    # An unchanged campaign is a no-op: every stage reports its cached result.
    again = job.execute_in_process(instance=instance, raise_on_error=False)
    assert again.success
    for stage in (
        "prompts",
        "teacher_generations",
        "distillation_set",
        "tokenized_dataset",
        "student_adapter",
        "evaluation",
    ):
        md = _metadata(again, AssetKey(["mini", stage]))
        assert md["reused"] is True and md["reused_from_run"] == result.run_id, stage
        assert md["time"].startswith("reused (took ") and ("nothing in this run" in md["cost"] or md["cost"] == "$0")
        assert not {"answers", "new_generations", "cache_hits"} & md.keys(), (stage, md.keys())  # not this run's work
    # promotion is once per candidate: the rerun reports the first run's promotion as reused
    promoted = _metadata(again, AssetKey(["mini", "promoted_model"]))
    assert promoted["reused"] is True and promoted["reused_from_run"] == result.run_id
    assert _metadata(result, AssetKey(["mini", "promoted_model"]))["reused"] is False


def _the_promoted_folder_is_portable(folder: Path, ev: dict, artifact_root: Path, tmp_path: Path, train: dict):
    """A model card the hub's library loads, whose model-index holds the gate's suites; no absolute path in any
    file of the folder; the adapter loads the documented way (``PeftModel.from_pretrained(base, folder)``) and
    holds the trained weights."""
    import json

    import torch
    from huggingface_hub import ModelCard
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from evaluation.drift import current_promoted
    from tests.conftest import MODELS_ROOT
    from tests.evaluation.test_model_card import hub_checks
    from tests.support.promoted_support import absolute_paths_in

    card = ModelCard.load(folder / "adapter" / "README.md")
    hub_checks(card)
    suites = {r.dataset_name for r in card.data.eval_results}
    assert suites == {k.removesuffix("_candidate_score") for k in ev if k.endswith("_candidate_score")}, suites
    assert "base_model" not in card.data.to_dict() and "`@demo/student`: a local model" in card.text  # no hub id
    assert absolute_paths_in(folder, [tmp_path, artifact_root, MODELS_ROOT, REPO]) == []
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "@demo/student"
    promoted = current_promoted(artifact_root / "mini")
    assert promoted.base_model_path().is_dir()  # recorded relative to the artifact root; drift resolves it there
    base = AutoModelForCausalLM.from_pretrained(str(promoted.base_model_path()), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder / "adapter"))
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    trained = load_file(str(Path(train["adapter"]) / "adapter_model.safetensors"))
    assert len(loaded) == len(trained) > 0
    assert all(torch.equal(loaded[k.replace(".weight", ".default.weight")], v) for k, v in trained.items())


def _gate_follows_its_materialization(instance: DagsterInstance, run_id: str, asset: AssetKey) -> None:
    """The run's gate check ran in a step of its own that started after the evaluation was materialized, its
    evaluation is stored later than that materialization, and it names it as its target."""
    mat = instance.fetch_materializations(asset, limit=1).records[0]
    rec = instance.event_log_storage.get_asset_check_execution_history(AssetCheckKey(asset, "gate"), limit=1)[0]
    assert rec.run_id == mat.event_log_entry.run_id == run_id and rec.event.timestamp > mat.timestamp
    assert rec.evaluation.target_materialization_data.storage_id == mat.storage_id
    step_start = next(
        e for e in instance.all_logs(run_id, of_type=DagsterEventType.STEP_START) if e.step_key == rec.event.step_key
    )
    assert step_start.timestamp > mat.timestamp, (rec.event.step_key, step_start.timestamp, mat.timestamp)


def test_broken_campaign_is_blocked_by_the_gate(tmp_path, artifact_root):
    path = _campaign(tmp_path, "mini_broken", learning_rate=0.0, max_steps=4)
    defs = build_definitions([str(path)], artifact_root=str(artifact_root))
    instance = DagsterInstance.ephemeral()
    result = defs.resolve_job_def(campaign_job_name("mini_broken")).execute_in_process(
        instance=instance, raise_on_error=False
    )
    assert not result.success
    # the blocking check is its own step, after the materialization it judges: only that step fails
    assert [e.step_key for e in result.all_events if e.is_step_failure] == ["mini_broken__evaluation_gate"]
    _gate_follows_its_materialization(instance, result.run_id, AssetKey(["mini_broken", "evaluation"]))
    checks = [e for e in result.get_asset_check_evaluations() if e.check_name == "gate"]
    assert checks and not checks[-1].passed
    assert checks[-1].metadata["verdict"].value == "NO-GO"
    reasons = checks[-1].metadata["reasons"].value  # the stated reason: the untrained student is under the floor
    assert "cipher: min_score: BREACH" in reasons and "< floor 80.0%" in reasons, reasons
    assert not result.asset_materializations_for_node("mini_broken__promoted_model")
    assert not (artifact_root / "mini_broken" / "promoted_model").exists()


def test_campaign_run_command_prints_scores_verdict_reason_and_cost(tmp_path, artifact_root, monkeypatch, capsys):
    """`campaign run` (what `make demo` calls): the three scores, the verdict with its reason, the cost
    from the ledger, and exit code 3 when the gate blocks promotion."""
    from campaign_app import cli

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    path = _campaign(tmp_path, "mini_cli", learning_rate=0.0, max_steps=4)
    rc = cli.main(["run", str(path), "--artifacts", str(artifact_root), "--log-level", "WARNING"])
    out = capsys.readouterr().out
    assert rc == cli.EXIT_BLOCKED, out
    for line in (
        "teacher   cipher (exact_match): 100.0%",
        "base      cipher (exact_match): 0.0%",
        "student   cipher (exact_match): 0.0%",
        "student ÷ teacher: 0.0%",
        "gate verdict: NO-GO",
        "cipher: min_score: BREACH",
        "--- cost (from the ledger) ---",
        "spent in this run: $",
    ):
        assert line in out, (line, out)
    assert not (artifact_root / "mini_cli" / "promoted_model").exists()
    first_run = out.split("dagster run id: ")[1].split()[0]
    assert "  student_adapter      ran " in out and "0 of 6 stages reused; ran prompts" in out, out
    # its tags: the verdict and the result's cost lead (Dagster orders them by key); the reaper's are hidden
    with DagsterInstance.get() as instance:
        tags = instance.get_run_by_id(first_run).tags
    shown = [k for k in tags if not k.startswith((".dagster/", "dagster/"))]
    assert shown[:2] == ["Cost", "Verdict"] and tags["Verdict"] == "NO-GO" and tags["Cost"].startswith("$"), tags
    assert not [k for k in shown if k.startswith("campaign/")] and {OWNER_TAG, LEASE_TAG} <= tags.keys(), tags

    # unchanged: every stage says where it came from, and the run spent nothing
    assert cli.main(["run", str(path), "--artifacts", str(artifact_root), "--log-level", "WARNING"]) == cli.EXIT_BLOCKED
    out = capsys.readouterr().out
    for stage in (
        "prompts",
        "teacher_generations",
        "distillation_set",
        "tokenized_dataset",
        "student_adapter",
        "evaluation",
    ):
        assert f"  {stage:20s} reused (key " in out and f", from run {first_run[:8]})" in out, (stage, out)
    assert "6 of 6 stages reused; nothing spent" in out and "spent in this run: $0.000000" in out, out

    # a changed gate re-judges the same answers: the evaluation stage runs, nothing upstream does
    spec = yaml.safe_load(path.read_text())
    spec["evaluation"]["gate"]["min_items"] = 41
    path.write_text(yaml.safe_dump(spec))
    assert cli.main(["run", str(path), "--artifacts", str(artifact_root), "--log-level", "WARNING"]) == cli.EXIT_BLOCKED
    out = capsys.readouterr().out
    # ... and bills nothing new: the answers were paid for by the first run (tests/e2e/test_rejudge_cost.py)
    assert f"  evaluation           re-judged (answers from run {first_run[:8]}), nothing spent" in out, out
    assert "5 of 6 stages reused; ran evaluation; nothing spent" in out, out
