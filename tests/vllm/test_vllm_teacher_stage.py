"""The demo campaign with ``teacher.backend: vllm``, end to end through the CLI (``campaign run``, what ``make demo``
calls), in its own process as a user runs it: the teacher stage generates with vLLM's CPU build, its manifest keys
the generations for the device and dtype vLLM ran in, and the teacher's answers are right (100% on the cipher). The
student is trained for 4 steps at learning rate 0, so the gate blocks it (exit 3): this test is about the teacher
stage, not the student."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from campaign_orchestrator.demo import cipher
from tests.support import REPO_ROOT as REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_the_demo_campaign_runs_its_teacher_stage_on_vllm(tmp_path, artifact_root):
    from campaign_app.cli.common import EXIT_BLOCKED
    from campaign_orchestrator.hardware import resolve_compute_dtype

    spec = yaml.safe_load((REPO / "campaigns" / "demo.yaml").read_text())
    spec["evaluation"]["suites"] = [s for s in spec["evaluation"]["suites"] if s.get("kind") != "lm_eval"]
    data = tmp_path / "data" / "prompts.jsonl"
    cipher.write_jsonl(cipher.items(700, seed=99), data)
    spec["name"] = "mini_vllm"
    spec.pop("schedule", None)
    spec["teacher"]["backend"] = "vllm"
    spec["data"]["source"] = str(data)
    spec["data"]["heldout"] = {"fraction": 0.12, "seed": 0}
    spec["training"].update({"max_steps": 4, "log_every": 10, "learning_rate": 0.0})
    spec["evaluation"]["gate"]["min_items"] = 40
    path = tmp_path / "mini_vllm.yaml"
    path.write_text(yaml.safe_dump(spec))

    env = dict(os.environ, DAGSTER_HOME=str(tmp_path / "dagster_home"))
    p = subprocess.run(
        [sys.executable, "-m", "campaign_app.cli", "run", str(path), "--artifacts", str(artifact_root)]
        + ["--log-level", "WARNING"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=1500,
    )
    out = p.stdout
    assert p.returncode == EXIT_BLOCKED, (p.returncode, out[-3000:], p.stderr[-3000:])
    assert "teacher   cipher (exact_match): 100.0%" in out and "  teacher_generations  ran " in out, out

    (manifest,) = (artifact_root / "mini_vllm" / "teacher_generations").glob("*/manifest.json")
    m = json.loads(manifest.read_text())
    dtype = resolve_compute_dtype("auto", "cpu").dtype  # what `auto` resolves to on this host, as for transformers
    assert m["model_identity"].startswith("vllm:") and m["model_identity"].endswith(f"|cpu:{dtype}"), m
    assert m["stats"]["compute_dtype"] == dtype and m["stats"]["generated"] == m["rows"] > 500
    assert m["errors"] == 0 and m["stats"]["finish_reasons"] == {"stop": m["rows"]}
