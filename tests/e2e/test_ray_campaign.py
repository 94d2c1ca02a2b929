"""The demo on Ray (``execution.executor: ray``) reaches the in-process demo's answers, scores and verdict.

One shrunken demo campaign, materialized through Dagster in-process, then again with its generation stages on
a local Ray cluster the stages start and stop (2 replicas; the teacher's generations, the teacher, candidate
and base answering held-out items), their outputs and the generation cache deleted in between.
Greedy generation in fp32: the teacher's completions, every item's answers, the scores and the verdict are
identical. The shipped ``campaigns/demo_ray.yaml`` is the same demo with ``execution: {executor: ray}``.
"""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest
import yaml
from dagster import AssetKey, DagsterInstance

from assets.location import build_definitions, campaign_job_name
from campaigns.loader import load_campaign_file
from tests.support import REPO_ROOT
from tests.support.campaign_support import demo_teacher, write_campaign

pytestmark = pytest.mark.slow


def _metadata(result, key: AssetKey) -> dict:
    mats = list(result.asset_materializations_for_node(key.to_python_identifier()))
    assert mats, f"no materialization of {key.to_user_string()}"
    return {k: v.value for k, v in mats[-1].metadata.items()}


def _run(path, root):
    defs = build_definitions([str(path)], artifact_root=str(root))
    result = defs.resolve_job_def(campaign_job_name("mini")).execute_in_process(
        instance=DagsterInstance.ephemeral(), raise_on_error=False
    )
    # (a few training steps: the gate may block the candidate; the two runs must agree on it)
    teacher = _metadata(result, AssetKey(["mini", "teacher_generations"]))
    ev = _metadata(result, AssetKey(["mini", "evaluation"]))
    gens = pq.read_table(next(root.glob("mini/teacher_generations/*/generations.parquet"))).to_pylist()
    items = pq.read_table(ev["items"]).to_pylist()
    return teacher, ev, gens, items, result


def test_shipped_demo_ray_is_the_demo_on_ray():
    demo = yaml.safe_load((REPO_ROOT / "campaigns" / "demo.yaml").read_text())
    ray = yaml.safe_load((REPO_ROOT / "campaigns" / "demo_ray.yaml").read_text())
    assert ray.pop("execution")["executor"] == "ray"
    for d in (demo, ray):
        d.pop("name"), d.pop("description"), d.pop("schedule", None)
    assert ray == demo
    assert load_campaign_file(REPO_ROOT / "campaigns" / "demo_ray.yaml").execution.executor == "ray"


def test_demo_on_ray_reaches_the_in_process_answers_and_verdict(tmp_path, artifact_root):
    """In-process first; then the generation stages' outputs and the whole generation cache are deleted and the
    same campaign runs again with ``execution.executor: ray``: the teacher and evaluation stages generate everything
    again on Ray, and the stages between them (distillation set, tokenized data, the trained adapter) are cache
    hits: their content keys say the teacher's generations on Ray were identical."""
    execution = {"executor": "ray", "replicas": 2, "num_cpus_per_replica": 1, "shard_prompts": 32}
    local = write_campaign(tmp_path / "local", "mini", demo_teacher(), prompts=160, max_steps=4)
    on_ray = write_campaign(tmp_path / "ray", "mini", demo_teacher(), prompts=160, max_steps=4, execution=execution)

    l_teacher, l_ev, l_gens, l_items, _ = _run(local, artifact_root)
    for stage in ("teacher_generations", "evaluation_items", "evaluation"):
        shutil.rmtree(artifact_root / "mini" / stage)
    shutil.rmtree(artifact_root / "cache")
    r_teacher, r_ev, r_gens, r_items, r_result = _run(on_ray, artifact_root)

    # the stages really ran on Ray: every shard done, by both workers, none from the cache
    done, total = r_teacher["shards"].split("/")
    assert done == total and int(total) > 1
    assert r_teacher["new_generations"] == l_teacher["new_generations"] > 0 and r_teacher["cache_hits"] == 0
    assert all(s["attempts"] == 1 and s["generated"] == s["requests"] for s in r_teacher["ray_shards"])
    assert len({s["worker"] for s in r_teacher["ray_shards"]}) == 2
    assert "ray_shards" not in l_teacher and "ray_shards" not in l_ev
    assert {k.split("@")[0] for k in r_ev["ray_shards"]} == {"candidate", "base", "teacher"}
    assert all(v.split("/")[0] == v.split("/")[1] for v in r_ev["ray_shards"].values())
    # greedy: identical teacher completions, identical answers of every model, identical scores and verdict
    assert [(g["id"], g["completion"]) for g in r_gens] == [(g["id"], g["completion"]) for g in l_gens]
    assert _metadata(r_result, AssetKey(["mini", "student_adapter"]))["reused"] is True
    key = lambda r: (r["model"], r["suite"], r["item_id"])  # noqa: E731
    assert sorted((key(r), r["output"], r["score"]) for r in r_items) == sorted(
        (key(r), r["output"], r["score"]) for r in l_items
    )
    assert {r["model"] for r in r_items} == {"candidate", "base", "teacher"}
    assert r_ev["verdict"] == l_ev["verdict"]
    for role in ("candidate", "base", "teacher"):
        assert r_ev[f"cipher_{role}_score"] == l_ev[f"cipher_{role}_score"]
