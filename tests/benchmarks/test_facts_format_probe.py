"""benchmarks/facts_format_probe.py --tiny: the real SmolLM2 trained on eight cities per spelling, scored on eight
held-out ones; the JSON names each spelling's tokens, its exact match on the cities and on those the base named in a
sentence."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.train_support import child_env

SCRIPT = REPO_ROOT / "benchmarks" / "facts_format_probe.py"


@pytest.mark.heavy
def test_tiny_trains_each_spelling_and_scores_it_against_that_spelling(tmp_path, smollm2):
    out = tmp_path / "probe.json"
    env = child_env(threads=1) | {"CAMPAIGN_TEST_MODELS_ROOT": str(smollm2.parents[2])}
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--targets", "lower", "title", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["items"] == rep["train_items"] == 8 and 0 <= rep["base_knew"] <= 8
    ref, title = rep["variants"]["lower"], rep["variants"]["title"]
    assert ref["target_example"].islower() and title["target_example"][0].isupper()
    assert ref["target_tokens"] and title["target_tokens"]
    for v in (ref, title):
        assert v["steps"] == 1 and 0 <= v["right"] <= 8 and v["exact_match"] == round(v["right"] / 8, 4)
        assert len(v["examples"]) == 4 and all(len(e) == 2 for e in v["examples"])
