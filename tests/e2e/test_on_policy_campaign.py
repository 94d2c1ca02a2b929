"""On-policy distillation through Dagster on a shrunken demo: a fully on-policy campaign has no teacher stage
(prompts feed student_adapter), its teacher is the project's own server (`python -m campaign_orchestrator.teacher
serve`: the `openai` backend and prompt_logprobs, a real process), and an unpriced teacher makes the stage's cost
unknown (never $0) while its training line is still recorded."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from dagster import AssetKey, DagsterInstance

from assets.location import build_definitions, campaign_job_name
from campaign_orchestrator.costs.ledger import DEFAULT_NAME, Ledger
from tests.support import REPO_ROOT
from tests.support.campaign_support import openai_teacher, write_campaign
from tests.support.train_support import child_env

pytestmark = pytest.mark.slow


def test_a_fully_on_policy_campaign_skips_the_teacher_stage_and_an_unpriced_teacher_is_unknown(
    tmp_path, artifact_root, demo_models
):
    port_file = tmp_path / "port"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "campaign_orchestrator.teacher",
            "serve",
            "--model",
            str(demo_models["teacher"]),
            "--served-name",
            "teacher",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--compute-dtype",
            "float32",
        ],
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not port_file.exists():
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()[-2000:]
            time.sleep(0.05)
        name = "mini_on_policy"
        teacher = openai_teacher(f"http://127.0.0.1:{port_file.read_text()}/v1", price="unpriced")
        path = write_campaign(tmp_path / "project", name, teacher, prompts=60, max_steps=4)
        import yaml

        spec = yaml.safe_load(path.read_text())
        spec["training"] |= {
            "eval_rows": 0,
            "distillation": {
                "loss": "on_policy",
                "teacher_tokenizer": str(demo_models["teacher"]),
                "on_policy": {
                    "lambda": 1.0,
                    "beta": 1.0,
                    "samples_per_round": 8,
                    "top_k": 8,
                    "temperature": 1.0,
                    "max_new_tokens": 10,
                    "teacher_generations": "none",
                },
            },
        }
        path.write_text(yaml.safe_dump(spec, sort_keys=False))

        defs = build_definitions([str(path)], artifact_root=str(artifact_root))
        keys = {k.path[-1] for k in defs.resolve_asset_graph().get_all_asset_keys() if k.path[0] == name}
        assert "student_adapter" in keys and not keys & {"teacher_generations", "distillation_set", "tokenized_dataset"}
        job = defs.resolve_job_def(campaign_job_name(name))
        result = job.execute_in_process(
            instance=DagsterInstance.ephemeral(),
            raise_on_error=False,
            asset_selection=[AssetKey([name, s]) for s in ("prompts", "student_adapter")],
        )
        assert result.success, [e.message for e in result.all_events if e.is_failure]
    finally:
        server.terminate()
        server.wait(30)
    mats = result.asset_materializations_for_node(AssetKey([name, "student_adapter"]).to_python_identifier())
    md = {k: v.value for k, v in mats[-1].metadata.items()}
    assert md["loss_kind"] == "on_policy" and md["steps"] == 4
    assert md["cost"].startswith("unknown") and "unpriced" in md["cost"]
    rounds = md["rounds"]
    assert len(rounds) == 2 and all(r["samples"] == 8 and r["teacher_prefill_tokens"] > 0 for r in rounds)
    ledger = Ledger(artifact_root / DEFAULT_NAME)
    made = ledger.query("SELECT asset, cost_unknown FROM materializations WHERE campaign = ?", [name])
    assert [(r["asset"], bool(r["cost_unknown"])) for r in made if r["asset"] == "student_adapter"] == [
        ("student_adapter", True)
    ]
    kinds = {r["kind"] for r in ledger.query("SELECT kind FROM cost_lines WHERE campaign = ?", [name])}
    assert kinds == {"training"}  # the trainer's host time is known; the teacher's scoring has no price
