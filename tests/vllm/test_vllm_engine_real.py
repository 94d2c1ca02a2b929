"""The ``vllm`` engine of a LocalModel on vLLM's CPU build, against transformers on the same weights: exactly
the same greedy answers on the demo teacher (vLLM's CPU attention takes its head size, 32), the same on >= 95% of
real prompts on SmolLM2-135M-Instruct with the same log-probabilities (1e-3), the same through a LoRA adapter
served as a ``LoRARequest`` as through PEFT, top-k at the campaign's k; and ``auto``'s probe measures vLLM beside
the other CPU engines."""

from __future__ import annotations

import pytest

from campaign_orchestrator.demo import cipher
from tests.vllm.conftest import close_engines, forced_logprobs, smollm2_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOL = 1e-3  # log-probability: vLLM's CPU kernels against transformers', both fp32


@pytest.fixture(scope="module")
def demo(demo_models):
    from campaign_orchestrator.generation.local import LocalModel

    gen = LocalModel.from_path(
        demo_models["teacher"], compute_dtype="float32", device="cpu", engine="vllm", batch_size=16
    )
    yield gen
    close_engines(gen)


def test_demo_teacher_greedy_answers_are_exactly_transformers(demo):
    cfg = demo.model.config
    assert cfg.head_dim == 32  # a head size vLLM's CPU attention takes (CPUAttentionBackend.get_supported_head_sizes)
    items = cipher.items(48, seed=5, id_prefix="v")
    prompts = [it["prompt"] for it in items] + ["encode " + "abcdefgh" * 8 + " ="]  # the last: past the context
    demo.engine = "vllm"
    got = demo.generate(prompts, 16, logprobs=3)
    assert demo.last_engine == "vllm" and demo.engines["vllm"].llm is not None
    assert demo.engines["vllm"].args["dtype"] == "float32" and demo.engines["vllm"].args["enable_prefix_caching"]
    demo.engine = "hf_generate"
    ref = demo.generate(prompts, 16, logprobs=3)
    assert ref[-1].finish_reason == "error" and all(c.ok for c in ref[:-1])
    assert [(c.text, c.token_ids, c.finish_reason, c.completion_tokens, c.prompt_tokens) for c in got] == [
        (c.text, c.token_ids, c.finish_reason, c.completion_tokens, c.prompt_tokens) for c in ref
    ]
    for g, r in zip(got[:-1], ref[:-1], strict=True):
        assert len(g.top_logprobs) == len(g.token_ids) and all(len(pos) == 3 for pos in g.top_logprobs)
        for gp, rp in zip(g.top_logprobs, r.top_logprobs, strict=True):
            assert [e[0] for e in gp] == [e[0] for e in rp]
            assert max(abs(a[2] - b[2]) for a, b in zip(gp, rp, strict=True)) < TOL
    # and the teacher is right: vLLM's answers are the cipher's
    assert sum(c.text.strip() == it["reference"] for c, it in zip(got, items, strict=False)) >= 0.9 * len(items)


def test_the_engine_probe_measures_vllm_beside_the_cpu_engines(demo, tmp_path):
    from campaign_orchestrator.generation import auto
    from campaign_orchestrator.generation.local import ENGINES

    engines = {n: demo.engine_instance(n) for n in ENGINES[1:]}
    name, rec = auto.choose(demo, engines, cache_dir=tmp_path, log=lambda _m: None)
    assert rec["measured_now"] and rec["device"] == "cpu"
    assert set(rec["engines"]) == {"continuous", "hf_generate", "vllm"}, rec
    assert "generate_batch" in rec["not_candidates"]
    speeds = {n: r["tokens_per_s"] for n, r in rec["engines"].items()}
    assert all(len(r["runs"]) == auto.REPEATS and r["tokens_per_s"] == max(r["runs"]) for r in rec["engines"].values())
    assert all(s > 0 for s in speeds.values()) and name == max(speeds, key=speeds.get)


@pytest.fixture(scope="module")
def smol(smollm2):
    from campaign_orchestrator.generation.local import LocalModel

    gen = LocalModel.from_path(smollm2, compute_dtype="float32", device="cpu", engine="vllm", batch_size=16)
    yield gen
    close_engines(gen)


def _agreement(gen, got, prompts, model) -> tuple[float, float]:
    """Share of ``got`` whose greedy tokens transformers (``model``, teacher-forced on them) would pick, and the
    largest gap between vLLM's top-1 log-probabilities and transformers' along them."""
    from campaign_orchestrator.dataset.formatting import render_prompt_ids

    same, gap = 0, 0.0
    for p, c in zip(prompts, got, strict=True):
        lps, argmax = forced_logprobs(model, render_prompt_ids(gen.tok, p), list(c.token_ids))
        same += argmax == list(c.token_ids)
        top1 = [pos[0] for pos in c.top_logprobs]
        assert [e[0] for e in top1] == list(c.token_ids)  # greedy: the chosen token is the top-1
        gap = max(gap, *(abs(e[2] - lp) for e, lp in zip(top1, lps, strict=True)))
    return same / len(got), gap


def test_smollm2_fp32_answers_and_logprobs_match_transformers(smol):
    prompts, teacher = smollm2_prompts(20, 20)
    k = teacher["sampling"]["logprobs"]  # the campaign's k (20)
    smol.engine = "vllm"
    got = smol.generate(prompts, 32, logprobs=k)
    assert smol.engines["vllm"].args["max_logprobs"] == k
    assert all(c.ok and c.top_logprobs and all(len(pos) == k for pos in c.top_logprobs) for c in got)
    smol.engine = "hf_generate"
    ref = smol.generate(prompts, 32, logprobs=k)
    same_text = sum(a.text == b.text for a, b in zip(got, ref, strict=True)) / len(got)
    assert same_text >= 0.95, [(a.text, b.text) for a, b in zip(got, ref, strict=True) if a.text != b.text]
    teacher_forced_same, gap = _agreement(smol, got, prompts, smol.model)
    assert teacher_forced_same >= 0.95 and gap < TOL, (teacher_forced_same, gap)
    # the top-k at every position: the same ids as transformers' where the answers are the same
    for a, b in zip(got, ref, strict=True):
        if a.token_ids == b.token_ids:
            for pa, pb in zip(a.top_logprobs, b.top_logprobs, strict=True):
                va, vb = sorted(e[2] for e in pa), sorted(e[2] for e in pb)
                assert max(abs(x - y) for x, y in zip(va, vb, strict=True)) < TOL


@pytest.fixture(scope="module")
def adapter(smollm2, tmp_path_factory):
    """A LoRA adapter trained on SmolLM2 for real: a few AdamW steps with PEFT on plural answers (r 8, the
    smollm2 campaign's attention projections, 8 steps of 8 examples), fp32."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from campaign_orchestrator.dataset.formatting import render_prompt_ids

    out = tmp_path_factory.mktemp("smollm2-lora")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    peft = get_peft_model(
        model,
        LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    words = ["cat", "box", "city", "leaf", "bus", "toy", "fox", "baby"]
    plural = {"cat": "cats", "box": "boxes", "city": "cities", "leaf": "leaves"}
    plural |= {"bus": "buses", "toy": "toys", "fox": "foxes", "baby": "babies"}
    rows = []
    for w in words:
        p = render_prompt_ids(tok, f"Plural of {w}?")
        a = tok(plural[w], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((p + a, [-100] * len(p) + a))
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        for ids, labels in rows:
            loss = peft(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0] / 2, losses  # it learned something: real steps
    peft.save_pretrained(str(out))
    return out


def test_a_lora_adapter_served_as_a_lora_request_scores_as_through_peft(smollm2, adapter, smol):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from campaign_orchestrator.generation.local import LocalModel

    prompts = [f"Plural of {w}?" for w in ("cat", "wolf", "dish", "story", "knife", "car", "glass", "key")]
    prompts += smollm2_prompts(0, 8)[0]
    cand = LocalModel.from_path(smollm2, adapter, compute_dtype="float32", device="cpu", engine="vllm")
    try:
        got = cand.generate(prompts, 24, logprobs=2)
        eng = cand.engines["vllm"]
        assert eng.args["model"] == str(smollm2) and eng.args["enable_lora"] and eng.args["max_lora_rank"] == 8
    finally:
        close_engines(cand)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32), str(adapter)
    ).eval()  # not merged: the LoRA matmuls as PEFT computes them
    same, gap = _agreement(cand, got, prompts, peft)
    assert same >= 0.95 and gap < TOL, (same, gap)
    # the adapter is applied: the base answers otherwise
    smol.engine = "vllm"
    base = smol.generate(prompts, 24)
    changed = sum(a.token_ids != b.token_ids for a, b in zip(got, base, strict=True))
    assert changed >= len(prompts) // 4, [(a.text, b.text) for a, b in zip(got, base, strict=True)]
