"""The continuous greedy engine of LocalModel (forward + DynamicCache; finished rows leave the batch,
waiting prompts take their room; prompts that share a prefix share its prefill) against transformers'
``generate``, and ``score`` (log-likelihood of given text) against a plain one-sequence forward pass."""

from __future__ import annotations

import pytest
import torch

from campaign_orchestrator.demo import cipher

WORDS = ["ab", "abcdefgh", "xy", "qrstuvwx", "hello", "z", "mnop", "abcabc", "kite", "quiz", "jj"]
HEADER = "ab=cd ef=gh ij=kl "  # a shared header of >= 8 tokens (a few-shot context stand-in)
TOO_LONG = "encode " + "abcdefgh" * 8 + " ="


_LOADED: dict = {}  # (teacher path, dtype) -> (model, tokenizer, precision): each loads once per module


def _gen(demo_models, dtype, **kw):
    """A fresh LocalModel (its own settings and stats) over the demo teacher loaded once in ``dtype``."""
    from campaign_orchestrator.generation.local import LocalModel, load_model

    kw.setdefault("engine", "continuous")
    key = (str(demo_models["teacher"]), dtype)
    if key not in _LOADED:
        _LOADED[key] = load_model(demo_models["teacher"], compute_dtype=dtype, device="cpu")
    model, tok, precision = _LOADED[key]
    return LocalModel(model, tok, kw.pop("batch_size", 64), precision, **kw)


def _prompts():
    plain = [cipher.prompt_for(w) for w in WORDS]
    return plain + [HEADER + p for p in plain[:6]] + [TOO_LONG]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_continuous_engine_is_token_identical_to_generate(demo_models, dtype):
    gen = _gen(demo_models, dtype, batch_size=3, max_batch_tokens=3 * 40)  # small batches: rows leave and join
    prompts = _prompts()
    new = gen.generate(prompts, 16, logprobs=3)
    st = dict(gen.last_stats)
    assert gen.last_shared_prefix >= 8  # the header group was prefilled once
    gen.engine = "hf_generate"
    old = gen.generate(prompts, 16, logprobs=3)
    assert st["prefills"] > 3 and st["prompts"] == len(prompts) - 1  # refilled many times; the long one skipped
    assert new[-1].finish_reason == "error" and "exceeds the teacher's context" in new[-1].error
    assert sum(c.ok for c in new[len(WORDS) :]) == 6  # the header group fits
    for a, b in zip(new, old, strict=True):  # input order, same tokens, same reasons, same top-k
        assert (a.text, a.token_ids, a.finish_reason, a.completion_tokens, a.prompt_tokens) == (
            b.text,
            b.token_ids,
            b.finish_reason,
            b.completion_tokens,
            b.prompt_tokens,
        )
        if a.ok:
            k = 3 if dtype == "float32" else 1  # bf16: near-tied runners-up may swap places in the last bits
            assert [[e[0] for e in pos[:k]] for pos in a.top_logprobs] == [
                [e[0] for e in pos[:k]] for pos in b.top_logprobs
            ]
            tol = 1e-4 if dtype == "float32" else 5e-2
            assert all(
                abs(x[2] - y[2]) <= tol
                for p, q in zip(a.top_logprobs, b.top_logprobs, strict=True)
                for x, y in zip(p[:k], q[:k], strict=True)
            )
            assert 0 < a.latency_s
    assert {c.finish_reason for c in new[:-1]} >= {"stop"}


def test_finished_rows_are_not_decoded_and_progress_is_reported(demo_models):
    gen = _gen(demo_models, "float32", batch_size=4)
    lines, done = [], []
    gen.log = lines.append
    gen._supports_continuous()  # its one-token probe forward is not a decoding step
    rows_per_step = []
    hook = gen.model.register_forward_pre_hook(
        lambda m, a, kw: rows_per_step.append(kw["input_ids"].shape) if "input_ids" in kw else None, with_kwargs=True
    )
    try:
        outs = gen.generate([cipher.prompt_for(w) for w in WORDS], 16, progress=done.append)
    finally:
        hook.remove()
    decoded = sum(s[0] for s in rows_per_step if s[1] == 1)  # one-token forwards: decoding steps
    # every row is decoded once per token after its first (which its prefill chose), and never after it stopped
    assert decoded == sum(c.completion_tokens - 1 for c in outs)
    assert sum(done) == len(WORDS)
    assert lines and "prompts/s" in lines[-1] and "tokens/s" in lines[-1] and f"{len(WORDS)}/{len(WORDS)}" in lines[-1]


def test_prefix_groups_share_what_all_their_members_share():
    from campaign_orchestrator.generation.local import prefix_groups

    a = list(range(10))
    # 0, 2 and 3 share their first 9 tokens (0 and 2 share 10, but 3 only 9); 1 and 4 share nothing
    groups = prefix_groups([a + [1], [7, 7], a + [2, 3], a[:9] + [5], [8]], min_tokens=8)
    assert sorted((sorted(g), p) for g, p in groups) == [([0, 2, 3], 9), ([1, 4], 0)]
    assert groups[-1] == ([1, 4], 0)  # the ungrouped come back together, last
    # a neighbour sharing fewer than min_tokens starts a group of its own: 3 leaves, 0 and 2 share 10
    assert sorted((sorted(g), p) for g, p in prefix_groups([a + [1], a + [2, 3], a[:9] + [5]], min_tokens=10)) == [
        ([0, 1], 10),
        ([2], 0),
    ]


def test_engine_choice(demo_models, monkeypatch):
    from campaign_orchestrator.generation.local import ENGINE_ENV, LocalModel, forced_engine

    with pytest.raises(ValueError, match="engine 'tensorrt' is unknown"):
        LocalModel(None, None, engine="tensorrt")
    g32 = _gen(demo_models, "float32", engine="auto")
    # the measurement switch: $CAMPAIGN_GENERATION_ENGINE decides what auto means (no probe runs)
    monkeypatch.setenv(ENGINE_ENV, "hf_generate")
    assert forced_engine() == "hf_generate" and LocalModel(g32.model, g32.tok).engine == "hf_generate"
    assert LocalModel(g32.model, g32.tok, engine="continuous").engine == "continuous"  # an explicit engine is kept
    monkeypatch.setenv(ENGINE_ENV, "tensorrt")
    with pytest.raises(ValueError, match=r"CAMPAIGN_GENERATION_ENGINE='tensorrt' is unknown"):
        forced_engine()


def test_sampling_stays_on_generate(demo_models, monkeypatch):
    gen = _gen(demo_models, "float32", batch_size=4)
    monkeypatch.setattr(
        gen.engine_instance("continuous"), "generate", lambda *a, **k: pytest.fail("sampling went to the greedy engine")
    )
    outs = gen.generate([cipher.prompt_for(w) for w in WORDS[:3]], 8, temperature=1.0, seed=3)
    again = gen.generate([cipher.prompt_for(w) for w in WORDS[:3]], 8, temperature=1.0, seed=3)
    assert [c.token_ids for c in outs] == [c.token_ids for c in again]


def test_score_matches_a_one_sequence_forward_and_generated_logprobs(demo_models):
    from campaign_orchestrator.dataset.formatting import render_prompt_ids

    gen = _gen(demo_models, "float32", batch_size=3)
    prompts = [cipher.prompt_for(w) for w in WORDS[:5]]
    outs = gen.generate(prompts, 16, logprobs=4)
    conts = [c.token_ids for c in outs[:3]] + [" zz", [5]]  # generated answers, a text, a single token
    scored = gen.score(prompts, conts, top_k=4)
    for p, c, s in zip(prompts, conts, scored, strict=True):
        ids = render_prompt_ids(gen.tok, p)
        c_ids = gen.tok(c, add_special_tokens=False)["input_ids"] if isinstance(c, str) else list(c)
        with torch.no_grad():
            ref = torch.log_softmax(gen.model(input_ids=torch.tensor([ids + c_ids])).logits[0].float(), -1)
        want = [ref[len(ids) - 1 + j, t].item() for j, t in enumerate(c_ids)]
        assert s.token_ids == c_ids and s.logprobs == pytest.approx(want, abs=1e-4) and s.prompt_tokens == len(ids)
        assert s.total == pytest.approx(sum(want), abs=1e-3)
    for c, s in zip(outs[:3], scored[:3], strict=True):  # the same numbers generation recorded
        assert [[e[0] for e in pos] for pos in s.top_logprobs] == [[e[0] for e in pos] for pos in c.top_logprobs]
        assert [pos[0][2] for pos in s.top_logprobs] == pytest.approx([pos[0][2] for pos in c.top_logprobs], abs=1e-4)
    bad = gen.score([TOO_LONG], [" x" * 10])[0]
    assert bad.error and "exceeds the model's context" in bad.error
    with pytest.raises(ValueError, match="one continuation per prompt"):
        gen.score(prompts, conts[:1])


def test_shards_on_two_workers_give_the_tokens_of_one_call(demo_models):
    """What a distributor relies on (campaign_orchestrator/generation/factories.py, promise 2): in fp32 a greedy answer
    does not depend on the other prompts of its call, so the prompts split into two shards, answered by two
    generators (two workers) with other batch shapes, give the tokens one call gives."""
    one = _gen(demo_models, "float32", batch_size=8)  # every prompt in one batch
    prompts = _prompts()[:-1]
    whole = one.generate(prompts, 16, logprobs=2)
    worker_a = _gen(demo_models, "float32", batch_size=2, max_batch_tokens=2 * 40)
    worker_b = _gen(demo_models, "float32", batch_size=3, max_batch_tokens=3 * 40)
    shard_a, shard_b = (
        worker_a.generate(prompts[0::2], 16, logprobs=2),
        worker_b.generate(prompts[1::2], 16, logprobs=2),
    )
    assert worker_a.last_stats["prefills"] > 2 and worker_b.last_stats["prefills"] > 2  # rows left and joined
    merged = [None] * len(prompts)
    merged[0::2], merged[1::2] = shard_a, shard_b
    assert [c.token_ids for c in merged] == [c.token_ids for c in whole]
    assert [(c.text, c.finish_reason) for c in merged] == [(c.text, c.finish_reason) for c in whole]
    assert [[[e[0] for e in pos] for pos in c.top_logprobs] for c in merged] == [
        [[e[0] for e in pos] for pos in c.top_logprobs] for c in whole
    ]
    assert {c.finish_reason for c in whole} >= {"stop"} and sum(len(c.token_ids) for c in whole) > len(prompts)
