"""``auto`` chooses the generation engine by a measured probe (campaign_orchestrator/generation/auto.py), and every
engine answers alike: the same text, token ids, stop reasons (and top-k where it can give them) on the demo
teacher."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from campaign_orchestrator.demo import cipher
from campaign_orchestrator.generation.completion import Completion

WORDS = ["ab", "abcdefgh", "xy", "qrstuvwx", "hello", "z", "mnop", "kite"]


class FakeEngine:
    """An engine that answers ``new`` tokens per prompt after ``delay`` seconds per prompt; counts its calls."""

    def __init__(self, name, delay, top_logprobs=True, devices=("cpu", "cuda"), fails=False):
        self.name, self.delay, self.top_logprobs, self.devices, self.fails = name, delay, top_logprobs, devices, fails
        self.calls = 0

    def unavailable(self):
        return None

    def generate(self, enc, max_new_tokens, logprobs=None, progress=None, on_result=None):
        self.calls += 1
        if self.fails:
            raise RuntimeError("no kernel for this model")
        time.sleep(self.delay * len(enc))
        return [Completion("x", "length", len(e), max_new_tokens, 0.0) for e in enc]


def _fake_gen(device="cpu"):
    cfg = SimpleNamespace(
        model_type="llama",
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return SimpleNamespace(
        device=torch.device(device),
        precision=SimpleNamespace(dtype="float32"),
        model=SimpleNamespace(config=cfg),
        tok=SimpleNamespace(all_special_ids=[0, 1]),
        stop_ids=[1],
        context_length=128,
    )


def test_auto_follows_measured_speed_and_never_picks_a_slow_engine(tmp_path):
    from campaign_orchestrator.generation.auto import REPEATS, choose

    slow = FakeEngine("slow", 0.004)
    fast = FakeEngine("fast", 0.0, top_logprobs=False)  # fastest, but returns no top-k (as generate_batch)
    mid = FakeEngine("mid", 0.001)
    engines = {"slow": slow, "fast": fast, "mid": mid}
    lines: list[str] = []
    name, rec = choose(_fake_gen(), engines, needs_topk=False, cache_dir=tmp_path, log=lines.append)
    assert name == "fast" and rec["measured_now"] and slow.calls == 1 + REPEATS  # warm-up + the timed runs
    assert "fast" in lines[-1] and "new tokens/s" in lines[-1]
    t = {n: r["tokens_per_s"] for n, r in rec["engines"].items()}
    assert t["fast"] > t["mid"] > t["slow"]
    # a request for top-k: the fastest engine that can return them, still never the slow one
    name, rec = choose(_fake_gen(), engines, needs_topk=True, cache_dir=tmp_path, log=lines.append)
    assert name == "mid" and not rec["measured_now"] and slow.calls == 1 + REPEATS  # read from the host cache
    assert "fast left out" in rec["why"]
    # an engine that fails its probe is recorded with its error and never chosen
    broken = FakeEngine("broken", 0.0, fails=True)
    name, rec = choose(_fake_gen(), {"broken": broken, "slow": slow}, cache_dir=tmp_path, log=lines.append)
    assert name == "slow" and "no kernel" in rec["engines"]["broken"]["error"]


def test_a_cuda_device_gets_a_probe_not_a_default(tmp_path):
    """On a (mocked) GPU the candidates for that device are measured; the CPU-tuned continuous engine is not one."""
    from campaign_orchestrator.generation.auto import REPEATS, choose

    cpu_only = FakeEngine("continuous", 0.0, devices=("cpu",))
    a, b = (
        FakeEngine("generate_batch", 0.002, top_logprobs=False, devices=("cpu", "cuda")),
        FakeEngine("hf_generate", 0.0, devices=("cpu", "cuda")),
    )
    name, rec = choose(
        _fake_gen(),
        {"continuous": cpu_only, "generate_batch": a, "hf_generate": b},
        cache_dir=tmp_path,
        device=torch.device("cuda"),
        log=lambda _m: None,
    )
    assert name == "hf_generate" and rec["device"] == "cuda" and rec["measured_now"]
    assert a.calls == b.calls == 1 + REPEATS and cpu_only.calls == 0
    assert "not a candidate on cuda" in rec["not_candidates"]["continuous"]
    assert rec["probe"]["prompts"] == 64  # the GPU probe's size, not the CPU's


@pytest.mark.stage
def test_a_real_generator_on_a_mocked_gpu_probes_its_engines(demo_models, tmp_path, monkeypatch):
    """The real engines over the demo teacher, the device said to be a GPU: each GPU candidate is measured (the
    continuous engine is not one; vLLM is not installed here) and auto picks the fastest that ran."""
    from campaign_orchestrator.generation import auto
    from campaign_orchestrator.generation.local import ENGINES, LocalModel

    monkeypatch.setitem(auto.PROBE, "cuda", (6, 4))  # a small probe: this test checks the path, not the speeds
    monkeypatch.setattr(auto, "REPEATS", 1)
    gen = LocalModel.from_path(demo_models["teacher"], compute_dtype="float32", device="cpu", batch_size=8)
    engines = {n: gen.engine_instance(n) for n in ENGINES[1:]}
    name, rec = auto.choose(gen, engines, cache_dir=tmp_path, device=torch.device("cuda"), log=lambda _m: None)
    speeds = {n: r["tokens_per_s"] for n, r in rec["engines"].items() if "tokens_per_s" in r}
    assert set(rec["engines"]) == {"hf_generate", "generate_batch"} and "continuous" in rec["not_candidates"]
    assert "vllm" in rec["not_candidates"] and name == max(speeds, key=speeds.get)


@pytest.mark.stage
def test_engines_return_equal_greedy_answers_on_the_demo_teacher(demo_models):
    from campaign_orchestrator.generation.local import LocalModel

    gen = LocalModel.from_path(demo_models["teacher"], compute_dtype="float32", device="cpu", batch_size=4)
    prompts = [cipher.prompt_for(w) for w in WORDS] + ["encode " + "abcdefgh" * 8 + " ="]  # the last: too long
    answers = {}
    for name in ("continuous", "hf_generate", "generate_batch"):
        gen.engine = name
        answers[name] = gen.generate(prompts, 16)
        assert gen.last_engine == name
    ref = answers["hf_generate"]
    assert ref[-1].finish_reason == "error" and all(c.ok for c in ref[:-1])
    for name, got in answers.items():
        assert [(c.text, c.token_ids, c.finish_reason, c.completion_tokens, c.prompt_tokens) for c in got] == [
            (c.text, c.token_ids, c.finish_reason, c.completion_tokens, c.prompt_tokens) for c in ref
        ], name
    # top-k: generate_batch cannot return it, so such a request runs on an engine that can, with the same answer
    gen.engine = "generate_batch"
    top = gen.generate(prompts[:3], 16, logprobs=2)
    assert gen.last_engine == "hf_generate" and [c.token_ids for c in top] == [c.token_ids for c in ref[:3]]
    assert all(len(pos) == 2 for c in top for pos in c.top_logprobs)
