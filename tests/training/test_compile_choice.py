"""``training.compile: auto`` on a CPU (training.compile_choice): decided by measurements on this host, cached, one
measurement per host; the trainer follows it and reports why.

The probe's cheap part (an eager step of a two-layer model of the student's architecture, and what capturing the
layers costs) runs here for real; inductor's part (a minute or more of code generation) runs in the ``heavy`` test."""

from __future__ import annotations

import json

import pytest
import torch

from training import compile_choice

TINY = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=299,
)


pytestmark = pytest.mark.stage  # the probe builds a model and captures it (seconds)


@pytest.fixture
def student():
    from tests.support.train_support import demo_spec

    return demo_spec().student


def test_a_run_too_short_to_pay_any_warmup_back_stays_eager_without_inductor(tmp_path, student):
    """Three layers x 2 micro-steps of 64 tokens take milliseconds eager; capturing the layer (forward and backward,
    as inductor starts) takes longer, measured: eager, decided without inductor's code generation, cached."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY)
    c = compile_choice.choose(cfg, student, torch.float32, tokens=64, micro_steps=2, cache_dir=tmp_path)
    m = c.measured
    assert c.compile is False and c.measured_now and c.layers == 3 and c.micro_steps == 2 and c.tokens == 64
    assert m["eager_s"] > 0 and m["capture_s"] > 0 and "compiled_s" not in m and m["attention"] == "sdpa"
    share = 3 / compile_choice.PROBE_LAYERS  # the run's layers, in probe models
    assert share * 2 * m["eager_s"] <= compile_choice.GRAPHS * m["capture_s"]  # the rule, on the measured figures
    assert "inductor not measured" in c.why
    cached = json.loads((tmp_path / compile_choice.CACHE_FILE).read_text())
    assert len(cached) == 1 and next(iter(cached)).endswith("|64|eager")
    again = compile_choice.choose(cfg, student, torch.float32, tokens=64, micro_steps=2, cache_dir=tmp_path)
    assert not again.measured_now and again.measured == m and again.compile is False


@pytest.mark.heavy  # inductor compiles the probe's layer: a minute or more on a 2-core host
def test_a_long_run_is_decided_by_inductors_measured_step_and_warmup(tmp_path, student):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY)
    micro_steps = 10**7  # long enough that any faster compiled step would pay its warm-up back
    c = compile_choice.choose(cfg, student, torch.float32, tokens=64, micro_steps=micro_steps, cache_dir=tmp_path)
    m = c.measured
    assert m["compiled_s"] > 0 and m["eager_s"] > 0 and m["warmup_s"] > 0 and c.measured_now
    saved = 3 / compile_choice.PROBE_LAYERS * micro_steps * (m["eager_s"] - m["compiled_s"])
    assert c.compile is (m["compiled_s"] < m["eager_s"] and saved > m["warmup_s"]), c
    cached = json.loads((tmp_path / compile_choice.CACHE_FILE).read_text())
    assert sorted(k.rsplit("|", 1)[1] for k in cached) == ["eager", "inductor"]
    # a short run on the same figures: the warm-up is not paid back, whatever the step
    short = compile_choice.choose(cfg, student, torch.float32, tokens=64, micro_steps=1, cache_dir=tmp_path)
    assert short.compile is False and not short.measured_now
