"""The code location: every campaign's assets and gate check, light imports, broken files isolated."""

import json
import subprocess
import sys

from dagster import AssetKey

from assets.common import STAGES
from assets.location import build_definitions, campaign_job_name
from tests.support import REPO_ROOT as REPO


def test_location_import_does_not_load_torch():
    code = (
        "import sys, json, campaign_app.definitions; print(json.dumps([m for m in ('torch', 'transformers', "
        "'datasets', 'peft', 'ray') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_campaign_has_its_graph_check_and_job():
    defs = build_definitions()
    keys = defs.resolve_all_asset_keys()
    for name in ("demo", "demo_broken"):
        for stage in STAGES:
            assert AssetKey([name, stage]) in keys
        assert defs.resolve_job_def(campaign_job_name(name)) is not None
        graph = defs.resolve_asset_graph()
        checks = {c.name for c in graph.asset_check_keys if c.asset_key == AssetKey([name, "evaluation"])}
        assert checks >= {"gate"}
        node = graph.get(AssetKey([name, "student_adapter"]))
        assert AssetKey([name, "tokenized_dataset"]) in node.parent_keys
        assert AssetKey(["demo_models", "student"]) in node.parent_keys
        assert graph.get(AssetKey([name, "prompts"])).group_name == name
    assert AssetKey(["demo_models", "teacher"]) in keys
    assert defs.resolve_schedule_def("demo_schedule").cron_schedule == "0 3 * * *"


def test_a_campaigns_automation_is_found_together():
    """Every sensor and schedule of a campaign is named after it and carries its `campaign` (sensors: definition
    tags, schedules: metadata), so the UI's Automation tab filters a campaign's automation together."""
    defs = build_definitions()
    for s in defs.sensors:
        if s.name == "reap_dead_campaign_runs":
            continue
        assert s.name.startswith(s.tags["campaign"] + "_") and s.tags["automation"], s.name
    for s in defs.schedules:
        campaign = s.metadata["campaign"].value
        assert s.name.startswith(campaign + "_") and s.metadata["automation"].value, s.name
    assert {s.tags["campaign"] for s in defs.sensors if s.tags} >= {"demo", "smollm2"}


def test_location_still_loads_with_a_broken_campaign(tmp_path):
    demo = (REPO / "campaigns" / "demo.yaml").read_text()
    bad = tmp_path / "typo.yaml"
    bad.write_text(demo.replace("name: demo", "name: typo").replace("max_steps: 150", "max_step: 150"))
    defs = build_definitions([str(REPO / "campaigns" / "demo.yaml"), str(bad)])
    keys = defs.resolve_all_asset_keys()
    assert AssetKey(["demo", "student_adapter"]) in keys
    assert AssetKey(["typo", "prompts"]) not in keys
    invalid = defs.resolve_asset_graph().get(AssetKey(["invalid_campaigns", "typo"]))
    assert "training.max_step: unknown key" in invalid.description


def test_cli_validate_reports_file_and_field(tmp_path):
    demo = (REPO / "campaigns" / "demo.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(demo.replace("  r: 16", "  r: sixteen"))
    run = subprocess.run(
        [sys.executable, "-m", "campaign_app.cli", "validate", str(REPO / "campaigns" / "demo.yaml"), str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert "ok       campaigns/demo.yaml" in run.stdout
    assert f"{bad}:" in run.stdout and "student.lora.r" in run.stdout and "'sixteen'" in run.stdout
    ok = subprocess.run(
        [sys.executable, "-m", "campaign_app.cli", "validate"], cwd=REPO, capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stdout


def test_every_asset_key_has_a_module_of_that_name():
    """`assets/<stage>.py` for a campaign's stage, `assets/<group>.py` for the demo models, the cluster
    ladder and invalid campaign files."""
    modules = {p.stem for p in (REPO / "assets").glob("*.py")}
    keys = build_definitions().resolve_all_asset_keys()
    missing = [k.to_user_string() for k in keys if k.path[-1] not in modules and k.path[0] not in modules]
    assert not missing and len(keys) > 10, missing


def test_a_sweep_campaign_has_its_sweep_step_and_trial_partitions():
    from dagster import DynamicPartitionsDefinition

    defs = build_definitions([str(REPO / "campaigns" / "demo_sweep.yaml")])
    graph = defs.resolve_asset_graph()
    sweep, trial = AssetKey(["demo_sweep", "hparam_sweep"]), AssetKey(["demo_sweep", "sweep_trial"])
    assert AssetKey(["demo_sweep", "tokenized_dataset"]) in graph.get(sweep).parent_keys
    assert sweep in graph.get(AssetKey(["demo_sweep", "student_adapter"])).parent_keys
    node = graph.get(trial)
    assert isinstance(node.partitions_def, DynamicPartitionsDefinition)
    assert node.partitions_def.name == "demo_sweep_sweep_trials" and not node.is_materializable
    job = defs.resolve_job_def(campaign_job_name("demo_sweep"))
    assert sweep in job.asset_layer.selected_asset_keys and trial not in job.asset_layer.selected_asset_keys
