"""data.replay through Dagster on the demo models: the replay prompts are answered by the base student (through
the local engine and the generation cache, under the identity evaluation answers the base with), join the
distillation set as `replay:` rows at the asked share, are decontaminated like the rest, and a rerun asks nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dagster import materialize

from assets import distillation_set, prompts, teacher_generations
from assets.location import default_resources
from campaign_orchestrator.demo import cipher
from campaigns.loader import parse_campaign_text

pytestmark = pytest.mark.stage


def _campaign(name: str, source: Path, replay: Path, dedupe: bool) -> str:
    return f"""
name: {name}
teacher: {{backend: transformers, model: "@demo/teacher", sampling: {{max_new_tokens: 16}}, batch_size: 64,
           hardware: cpu-2vcpu}}
student: {{base_model: "@demo/student", quantization: {{load_in_4bit: false, compute_dtype: float32}}}}
data:
  source: "{source}"
  heldout: {{fraction: 0.2, seed: 0}}
  filters: {{dedupe: {str(dedupe).lower()}}}
  replay: {{source: "{replay}", answered_by: base, share: 0.25, max_new_tokens: 8}}
training: {{max_steps: 1, max_seq_len: 64, hardware: cpu-2vcpu}}
evaluation:
  suites:
    - {{name: cipher}}
"""


def _meta(result, stage):
    ev = next(e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == stage)
    return {k: v.value for k, v in ev.event_specific_data.materialization.metadata.items()}


def test_replay_rows_are_the_base_students_cached_answers(tmp_path, artifact_root):
    from campaign_orchestrator.dataset import prompts as P

    rows = cipher.items(30, seed=7)
    src = cipher.write_jsonl(rows, tmp_path / "prompts.jsonl")
    _train, held = P.split([dict(r) for r in rows], 0.2, 0, None)
    leaked = held[0]["prompt"]  # a replay prompt that is a gate document: dropped like any training row
    general = [{"id": f"g{i:02d}", "prompt": p["prompt"]} for i, p in enumerate(cipher.items(20, seed=99))]
    general[0]["prompt"] = leaked
    rsrc = tmp_path / "general.jsonl"
    rsrc.write_text("".join(json.dumps(r) + "\n" for r in general))

    spec = parse_campaign_text(_campaign("replay_a", src, rsrc, True), str(tmp_path / "replay_a.yaml"))
    res = materialize(
        [prompts.build(spec), teacher_generations.build(spec), distillation_set.build(spec)],
        resources=default_resources(str(artifact_root)),
    )
    md = _meta(res, "distillation_set")
    r = md["replay"]
    task = md["input_rows"] - sum(v for k, v in md.items() if k.startswith("dropped_") and k != "dropped_contaminated")
    asked = round(0.25 / 0.75 * (task - 0))  # share 0.25 of the mix: a third of the task rows, from the first ids
    assert r["answered_by"] == "base" and r["prompts"] == asked and r["generated"] == asked and r["cache_hits"] == 0
    # filtered (empty, truncated, duplicates) like the teacher's rows, then the leaked one is dropped
    assert md["dropped_contaminated"] == 1 and md["replay_rows"] == r["filter_counts"]["kept"] - 1 > 0
    table = pq.read_table(Path(md["path"]) / "distillation.parquet").to_pylist()
    replay = {x["id"]: x for x in table if x["id"].startswith("replay:")}
    assert len(replay) == md["replay_rows"] and set(replay) <= {f"replay:g{i:02d}" for i in range(1, asked)}
    assert leaked not in {x["prompt"] for x in table}

    # the answers are the base student's: the generation cache holds them under the base's identity, and a
    # backend that would fail if asked finds them all there
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.requests import Sampling, namespace
    from campaign_orchestrator.generation.runner import run_generation
    from resources.storage import ArtifactStore
    from stages.answers import answer_identity

    storage = ArtifactStore(root=str(artifact_root))
    ident, _ = answer_identity(spec, storage.resolve_model("@demo/student", spec.project_dir), None)

    class Refuses:
        name, model, identity = "refuses", "none", ident

        def run(self, *_a, **_k):
            raise AssertionError("asked a model: the replay answers should all be cached")

        def stats(self):
            return {}

    s = Sampling(max_new_tokens=8)
    again = run_generation(
        [{"id": k, "prompt": v["prompt"]} for k, v in replay.items()],
        Refuses(),
        s,
        GenerationCache(storage.cache_store(), namespace(ident, s), storage.spool_dir()),
    )
    assert [x["completion"] for x in again.rows] == [v["completion"] for v in replay.values()]

    # a rerun (here: another filter setting, so a new distillation set) asks nothing
    spec = parse_campaign_text(_campaign("replay_a", src, rsrc, False), str(tmp_path / "replay_a.yaml"))
    res = materialize(
        [prompts.build(spec), teacher_generations.build(spec), distillation_set.build(spec)],
        resources=default_resources(str(artifact_root)),
    )
    r2 = _meta(res, "distillation_set")["replay"]
    assert r2["generated"] == 0 and r2["cache_hits"] == asked and r2["usd"] == 0
