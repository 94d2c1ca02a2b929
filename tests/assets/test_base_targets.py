"""data.targets.content: base through Dagster on the demo models: the base student answers every task prompt (the
local engine and the generation cache, as replay), and each target becomes the teacher's short form its answer names.

The demo's base copies the word ("encode abc =" -> "abc") and the teacher enciphers it. The prompts hold words and
their own enciphered forms, so for the prompt of an enciphered word the base's copy names an answer the teacher gave
elsewhere in the task: the target becomes that copy, not the teacher's answer (``changed``). For a plain word the
base names nothing the teacher said: the row is dropped (``unnamed``)."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dagster import materialize

from assets import distillation_set, prompts, teacher_generations
from assets.location import default_resources
from campaign_orchestrator.demo import cipher
from campaigns.loader import parse_campaign_text

# teacher and base answers on the demo models through Dagster (a minute on a 2-core host): `make test-heavy`; the
# targets logic itself is tested on tiny real data in tests/campaign_orchestrator/dataset/test_targets.py, which
# `make test` runs
pytestmark = [pytest.mark.stage, pytest.mark.heavy]


def _campaign(source: Path, targets: str) -> str:
    return f"""
name: targets_demo
teacher: {{backend: transformers, model: "@demo/teacher", sampling: {{max_new_tokens: 16}}, batch_size: 64,
           hardware: cpu-2vcpu}}
student: {{base_model: "@demo/student", quantization: {{load_in_4bit: false, compute_dtype: float32}}}}
data:
  source: "{source}"
  heldout: {{fraction: 0.1, seed: 0}}
  {targets}
training: {{max_steps: 1, max_seq_len: 64, hardware: cpu-2vcpu}}
evaluation:
  suites:
    - {{name: cipher}}
"""


def _meta(result, stage):
    ev = next(e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == stage)
    return {k: v.value for k, v in ev.event_specific_data.materialization.metadata.items()}


def _run(spec, root):
    res = materialize(
        [prompts.build(spec), teacher_generations.build(spec), distillation_set.build(spec)],
        resources=default_resources(str(root)),
    )
    return _meta(res, "distillation_set")


def test_targets_from_the_bases_own_answers(tmp_path, artifact_root):
    rng = random.Random(3)
    words = sorted({cipher.random_word(rng) for _ in range(16)})
    rows = [
        {"id": f"{tag}{i:02d}", "prompt": cipher.prompt_for(w), "reference": cipher.encode(w)}
        for i, word in enumerate(words)
        for tag, w in (("w", word), ("e", cipher.encode(word)))
    ]
    src = cipher.write_jsonl(rows, tmp_path / "prompts.jsonl")

    plain = _run(parse_campaign_text(_campaign(src, ""), str(tmp_path / "t.yaml")), artifact_root)
    assert "targets" not in plain  # the default trains on the teacher's answers as they are

    spec = parse_campaign_text(_campaign(src, "targets: {content: base, max_new_tokens: 12}"), str(tmp_path / "t.yaml"))
    md = _run(spec, artifact_root)
    t = md["targets"]
    assert t["rule"] == "short_form" and t["input"] > 0 and t["unanswered"] == 0
    assert t["generated"] == t["input"] and t["cache_hits"] == 0  # the base answered every task prompt once
    assert t["kept"] + t["unnamed"] == t["input"] and md["rows"] <= t["kept"] == md["targets_kept"]
    # the base's copy of an enciphered word names the teacher's answer for the plain word: the copy is the target
    assert t["changed"] > 0 and md["targets_changed"] == t["changed"]
    for x in t["examples_changed"]:
        word = x["prompt"].removeprefix("encode ").removesuffix(" =")
        assert x["target"].strip() == word != x["teacher"].strip()
    # a plain word's copy names nothing the teacher said (nor does a word whose plain form was held out): dropped
    assert t["unnamed"] > 0 and any(x["prompt"].split()[1] in words for x in t["examples_dropped"])
    table = pq.read_table(Path(md["path"]) / "distillation.parquet").to_pylist()
    vocabulary = {x["completion"].strip() for x in pq.read_table(plain["path"] + "/distillation.parquet").to_pylist()}
    assert len(table) == md["rows"] and {r["completion"].strip() for r in table} <= vocabulary

    # a rerun with another rule asks the base nothing (the generation cache, as replay)
    spec = parse_campaign_text(
        _campaign(src, "targets: {content: base, rule: agree, max_new_tokens: 12}"), str(tmp_path / "t.yaml")
    )
    again = _run(spec, artifact_root)["targets"]
    assert again["generated"] == 0 and again["cache_hits"] == t["input"] and again["changed"] == 0
    assert again["kept"] + again["disagree"] == t["input"] and again["kept"] >= t["kept"] - t["changed"]
