"""campaigns/demo_teachers.yaml as shipped, end to end through Dagster (issue 45, a teacher per category): the short
words to the ``short`` teacher, the rest to the default ``general`` one, to a GO verdict, each row of the distillation
set naming its teacher, the cost report with each teacher's spend and the gate report with each category's teacher.
~40 s of CPU for the whole demo (2,200 prompts, 150 steps; docs/results.md, "A teacher per category"). The teacher
stage's content keys with several teachers: tests/stages/test_teachers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from dagster import AssetKey, DagsterInstance

from assets.location import build_definitions, campaign_job_name
from campaign_orchestrator.costs.report import render_text
from tests.support import REPO_ROOT as REPO

# the whole demo through Dagster: `make test-heavy`; the routing, keys, shares and cost lines are
# tested stage by stage in tests/stages/test_teachers.py, which `make test` runs
pytestmark = [pytest.mark.stage, pytest.mark.heavy]

NAME = "demo_teachers"


def _shipped(tmp_path, change=None):
    spec = yaml.safe_load((REPO / "campaigns" / f"{NAME}.yaml").read_text())
    spec.pop("schedule", None)
    spec.pop("automation", None)
    spec["data"]["source"] = str(REPO / "campaigns" / "data" / "demo" / "*.jsonl")
    if change:
        change(spec)
    path = tmp_path / f"{NAME}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _run(path, root, stages=None):
    defs = build_definitions([str(path)], artifact_root=str(root))
    job = defs.resolve_job_def(campaign_job_name(NAME))
    sel = {"asset_selection": [AssetKey([NAME, s]) for s in stages]} if stages else {}
    result = job.execute_in_process(instance=DagsterInstance.ephemeral(), raise_on_error=False, **sel)
    assert result.success
    return result


def _manifest(root, stage: str) -> dict:
    return json.loads((root / NAME / stage / "LATEST.json").read_text())


def test_two_teachers_routed_by_category_reach_go_and_each_is_priced(tmp_path, artifact_root):
    _run(_shipped(tmp_path), artifact_root)

    ev = _manifest(artifact_root, "evaluation")
    assert ev["verdict"] == "GO", ev.get("reasons")
    # the gate report reads each category's own teacher as its reference
    ref = {r["category"]: r for r in ev["teacher_reference"]["cipher"]}
    assert ref["short"]["teacher"] == "short" and ref["long"]["teacher"] == "general"
    assert ref["short"]["teacher_score"] >= 0.9 and ref["long"]["teacher_score"] >= 0.9
    report = Path(ev["report_path"]).read_text()
    assert "| cipher | short |" in report and "(short) |" in report and "(general) |" in report

    # each row names the teacher of its category
    prompts = _manifest(artifact_root, "prompts")
    cat = {r["id"]: r["category"] for r in pq.read_table(prompts["train_path"]).to_pylist()}
    rows = pq.read_table(_manifest(artifact_root, "distillation_set")["distillation_path"]).to_pylist()
    assert {r["teacher"] for r in rows} == {"short", "general"}
    assert all(r["teacher"] == ("short" if cat[r["id"]] == "short" else "general") for r in rows)

    # each teacher scored on its own held-out categories only
    held = pq.read_table(prompts["heldout_path"]).to_pylist()
    n_short = sum(r["category"] == "short" for r in held)
    assert ev["answers"]["teacher short"]["generated"] == n_short
    assert ev["answers"]["teacher general"]["generated"] == len(held) - n_short

    # the cost report: each teacher's spend, adding up to the teacher's part of the result
    cost = _manifest(artifact_root, "campaign_cost")
    t = cost["teachers"]
    assert set(t) == {"short", "general"} and t["short"]["categories"] == ["short"]
    assert t["short"]["rows"] + t["general"]["rows"] == len(rows)
    for x in t.values():
        assert x["generations_usd"] > 0 and x["scoring_usd"] > 0 and not x.get("stopped")
    assert sum(x["generations_usd"] for x in t.values()) == pytest.approx(cost["teacher_usd"])
    line = next(x for x in render_text(json.loads(Path(cost["report_path"]).read_text())) if "per teacher" in x)
    assert line.startswith("spend per teacher: general $") and "; short $" in line and "(short; 1," in line
