"""The shipped real-model campaign (campaigns/smollm2.yaml: SmolLM2-135M-Instruct as teacher and LoRA
student) end to end through Dagster, shrunken to fit the suite: the same code path, fewer prompts,
items and steps. Shrunken, the student trains a few steps on 80 + 80 prompts: it learns part of the task
(above its base, short of the full campaign's 80%, which `make real` measures: README) and the gate
judges both suites on the paired interval; the test checks the verdict it reaches, per suite and overall,
against the one its scores and the campaign's thresholds call for (which of the three that is depends on
how far a few steps get). The same campaign at 100x its learning rate breaches the general suite and is
NO-GO (at 20x, on these 60 items, it lost 17 pts: INCONCLUSIVE, not yet a breach)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, DagsterInstance

from assets.location import build_definitions, campaign_job_name
from campaign_orchestrator.hardware import resolve_compute_dtype
from tests.support import REPO_ROOT as REPO

# minutes on a 2-core host (the SmolLM2 teacher, training and two suites, twice): `make test-heavy` runs it
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

DATA = REPO / "campaigns" / "data" / "smollm2"


def _take(src: Path, dst: Path, n: int) -> str:
    """``n`` rows of ``src`` spread over the whole file (the suites are sorted by category)."""
    rows = src.read_text().splitlines(keepends=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(rows[i * len(rows) // n] for i in range(n)))
    return str(dst)


def _campaign(tmp_path: Path, name: str, lr_factor: float = 1.0, general_only: bool = False) -> Path:
    spec = yaml.safe_load((REPO / "campaigns" / "smollm2.yaml").read_text())
    data = tmp_path / f"data-{name}"
    # the over-training run trains 6 steps (48 rows): 24 + 24 prompts are enough, and the teacher is the slow part
    prompts = 24 if general_only else 80
    _take(DATA / "train-plural.jsonl", data / "train-plural.jsonl", prompts)
    _take(DATA / "train-general.jsonl", data / "train-general.jsonl", prompts)
    spec["name"] = name
    spec["data"]["source"] = str(data / "train-*.jsonl")
    spec["training"]["learning_rate"] *= lr_factor
    # compile: auto would measure inductor on this CPU first (minutes, once per host: training/compile_choice.py,
    # tested in tests/training/test_compile_choice.py); this test is about the campaign's outcome
    spec["training"]["compile"] = False
    spec["teacher"]["sampling"]["max_new_tokens"] = 32  # the shipped 64 keeps more general replay; 32 is faster
    suites = {s["name"]: s for s in spec["evaluation"]["suites"]}
    suites["plurals"]["source"] = _take(DATA / "suite-plural.jsonl", data / "suite-plural.jsonl", 60)
    suites["general"]["source"] = _take(DATA / "suite-general.jsonl", data / "suite-general.jsonl", 60)
    if general_only:  # the regression side alone (the task side is the GO test's), a few steps at that rate
        spec["training"].pop("epochs")
        spec["training"]["max_steps"] = 6
        spec["evaluation"]["suites"] = [suites["general"]]
        spec["evaluation"]["gate"]["min_score"] = None
        spec["evaluation"]["score_teacher"] = False
    spec["evaluation"]["gate"]["min_items"] = 40
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(path: Path, name: str, artifact_root: Path):
    defs = build_definitions([str(path)], artifact_root=str(artifact_root))
    result = defs.resolve_job_def(campaign_job_name(name)).execute_in_process(
        instance=DagsterInstance.ephemeral(), raise_on_error=False
    )
    failed = [e.step_key for e in result.all_events if e.is_step_failure]
    assert set(failed) <= {f"{name}__evaluation_gate"}, failed  # a NO-GO fails the gate check's step, nothing else
    mats = result.asset_materializations_for_node(AssetKey([name, "evaluation"]).to_python_identifier())
    return {k: v.value for k, v in mats[-1].metadata.items()}, result


def _gate(result, artifact_root: Path, name: str) -> dict:
    """The gate's numbers per suite (candidate score, paired delta interval, verdict) from the judgement the blocking
    check reads (``gate.json``; the check's metadata shows them in percent), and that check's verdict."""
    check = next(e for e in result.get_asset_check_evaluations() if e.check_name == "gate")
    manifest = json.loads((artifact_root / name / "evaluation" / "LATEST.json").read_text())
    doc = json.loads(Path(manifest["gate_path"]).read_text())
    out = {"verdict": check.metadata["verdict"].value}
    for s in doc["suites"]:
        d = s["overall"]["delta"]
        out |= {
            f"{s['suite']}_delta_lo": d["lo"],
            f"{s['suite']}_delta_hi": d["hi"],
            f"{s['suite']}_candidate": s["candidate"]["score"],
            f"{s['suite']}_verdict": s["verdict"],
        }
    return out


def expected_verdicts(gate: dict) -> dict[str, str]:
    """The verdict the shipped campaign's gate (campaigns/smollm2.yaml) must reach from these numbers, per suite
    and overall: plurals under its floor (``min_score``) is NO-GO; a suite whose whole candidate - base interval is
    below the allowed drop is NO-GO, one whose interval straddles it INCONCLUSIVE (the empty-output, error and
    item-count rules are expected to pass: any of them failing fails this test, as it should for this recipe)."""
    g = yaml.safe_load((REPO / "campaigns" / "smollm2.yaml").read_text())["evaluation"]["gate"]
    floor, drop = g["min_score"], g["max_regression_vs_base"]
    out = {}
    for suite in ("plurals", "general"):
        lo, hi = gate[f"{suite}_delta_lo"], gate[f"{suite}_delta_hi"]
        below_floor = suite == "plurals" and gate[f"{suite}_candidate"] < floor
        out[suite] = "NO-GO" if below_floor or hi < -drop else "INCONCLUSIVE" if lo < -drop else "GO"
    verdicts = set(out.values())
    out["overall"] = "NO-GO" if "NO-GO" in verdicts else "INCONCLUSIVE" if "INCONCLUSIVE" in verdicts else "GO"
    return out


def test_real_model_campaign_runs_end_to_end_and_a_hundred_times_its_learning_rate_is_no_go(
    smollm2, tmp_path, artifact_root
):
    ev, result = _run(_campaign(tmp_path, "smol_mini"), "smol_mini", artifact_root)
    gate = _gate(result, artifact_root, "smol_mini")
    want = expected_verdicts(gate)  # from the scores against base and the campaign's thresholds
    assert (ev["verdict"], gate["plurals_verdict"], gate["general_verdict"]) == (
        want["overall"],
        want["plurals"],
        want["general"],
    ), (want, ev["report"])
    assert ev["plurals_base_score"] <= 0.1 and ev["plurals_teacher_score"] >= 0.6
    assert ev["plurals_candidate_score"] > ev["plurals_base_score"] + 0.1  # it learned from the teacher
    # The suite holds only what the base answers, fixed before training on an fp32 host; where `auto` is bf16
    # (a CPU with AVX512-BF16) the base misses one or two of these 60.
    assert ev["general_base_score"] >= 0.95
    train = {
        k: v.value
        for k, v in result.asset_materializations_for_node(
            AssetKey(["smol_mini", "student_adapter"]).to_python_identifier()
        )[-1].metadata.items()
    }
    assert train["final_loss"] < train["first_loss"]
    assert train["compute_dtype"] == resolve_compute_dtype("auto", "cpu").dtype  # fp32 on AVX2, bf16 on AVX512-BF16
    tok = {
        k: v.value
        for k, v in result.asset_materializations_for_node(
            AssetKey(["smol_mini", "tokenized_dataset"]).to_python_identifier()
        )[-1].metadata.items()
    }
    assert tok["template"] == "chat"
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["stop_token_trained"]
    # the teacher is the student's own model: the token-id path (no byte alignment), every answer token covered
    assert "teacher_uld_share" not in tok and tok["teacher_topk_positions"] > 0

    over, _ = _run(_campaign(tmp_path, "smol_over", lr_factor=100.0, general_only=True), "smol_over", artifact_root)
    assert over["verdict"] == "NO-GO"
    assert "**general** (NO-GO): max_regression_vs_base: BREACH" in over["report"], over["report"]
