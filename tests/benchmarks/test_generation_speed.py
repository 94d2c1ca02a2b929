"""benchmarks/generation_speed.py --tiny: both engines on the demo teacher, outputs compared, a JSON report; its
``--device cuda`` sections are skipped cleanly on a host without a GPU; its ``engines`` section on a CPU measures
every local engine (vLLM where its CPU build is importable: tests/vllm/ runs the script there)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.train_support import child_env

SCRIPT = REPO_ROOT / "benchmarks" / "generation_speed.py"


@pytest.mark.stage
def test_tiny_compares_both_engines_and_reports_identical_outputs(tmp_path, demo_models):
    import torch

    gpu = torch.cuda.is_available()  # without one, the cuda section must be skipped with its reason, exit 0
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--sections",
            "teacher" if gpu else "teacher,engines",
            "--prompts",
            "12",
            "--out",
            str(tmp_path / "r.json"),
        ]
        + ([] if gpu else ["--device", "cuda"]),
        cwd=REPO_ROOT,
        env=child_env(threads=1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads((tmp_path / "r.json").read_text())
    if not gpu:
        assert out["sections"]["engines"] == {
            "skipped": "no CUDA device on this host (torch sees none): the cuda sections did not run"
        }
    r = out["sections"]["teacher"]
    assert out["failed"] == [] and r["outputs_identical"] and r["differing_prompts"] == 0
    assert r["new"]["engine"] == "continuous" and r["old"]["engine"] == "hf_generate" and r["prompts"] == 12
    assert r["prompts_per_s_ratio"] > 0 and r["peak_rss_ratio"] > 0 and r["new"]["threads"] == 1
    assert r["per_suite"]["teacher"]["shared_prefix_new"] >= 8  # the header group shared its prefill


@pytest.mark.stage
def test_tiny_engines_section_on_a_cpu_measures_every_engine_and_autos_choice(tmp_path, demo_models):
    from campaign_orchestrator.generation.engines.vllm_engine import vllm_importable

    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--sections", "engines", "--device", "cpu", "--prompts", "12"]
        + ["--out", str(tmp_path / "r.json")],
        cwd=REPO_ROOT,
        env=child_env(threads=1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    rec = json.loads((tmp_path / "r.json").read_text())["sections"]["engines"]["shapes"]["demo-teacher"]
    ran = {n for n, r in rec["engines"].items() if "tokens_per_s" in r}
    assert {"hf_generate", "continuous", "generate_batch"} <= ran
    assert all(rec["engines"][n]["same_as_hf_generate"] == 1.0 for n in ran)
    assert ("vllm" in ran) == vllm_importable(), rec["engines"]["vllm"]
    probe = rec["auto"]["probe"]
    assert rec["auto"]["chosen"] == max(probe, key=lambda n: probe[n].get("tokens_per_s", 0))
    assert all(len(r["runs"]) == 3 for r in probe.values())


def test_the_bf16_sign_test_fails_only_a_clearly_less_faithful_engine():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from generation_speed import SIGN_TEST_ALPHA, sign_test_p

    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(1, 1) == 0.75  # P(X <= 1), X ~ Binomial(2, 1/2)
    assert sign_test_p(48, 59) > SIGN_TEST_ALPHA  # this session's evaluation run: noise
    assert sign_test_p(5, 20) < SIGN_TEST_ALPHA  # new loses 20 of 25 near-ties: less faithful
    assert sign_test_p(54, 39) > 0.9
