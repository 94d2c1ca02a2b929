"""The in-process teacher scorer: prompts that share a long prefix (a teacher's context) are scored with the
prefix's cache computed once, and give the log-probabilities and top-k of the plain one-pass scoring."""

from __future__ import annotations

import pytest


def test_prefix_cached_scoring_equals_plain_scoring(demo_models):
    import torch

    threads = torch.get_num_threads()
    try:
        _check_prefix_cached_scoring(demo_models)
    finally:
        torch.set_num_threads(threads)


def _check_prefix_cached_scoring(demo_models):
    import torch

    from campaign_orchestrator.generation.local import LocalModel
    from training.on_policy import LocalScorer

    torch.set_num_threads(1)  # as a trainer process runs (restored below): on a busy host more threads only spin
    gen = LocalModel.from_path(demo_models["teacher"], compute_dtype="float32", batch_size=3, device="cpu")
    context = "encode abc = nop encode hello = itssg encode "  # > 32 shared tokens (a character tokenizer)
    prompts = [context + w + " =" for w in ("cat", "dog", "parrots", "a", "hello")] + ["encode zebra ="]
    tok = gen.tok
    conts = [
        tok(" " + w, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        for w in ("eqz", "rgu", "xy", "qwertyuiop", "itssg", "mtwjq")
    ]
    cached = LocalScorer(gen, "demo")
    groups = []
    score_group = cached._score_group
    cached._score_group = lambda enc, cont, shared, k: (
        groups.append((len(enc), shared)) or score_group(enc, cont, shared, k)
    )
    got = cached.score(prompts, conts, top_k=5)
    assert len(groups) == 1 and groups[0][0] == 5 and groups[0][1] >= 32, groups  # the context went through its cache
    plain = LocalScorer(gen, "demo", prefix_caching=False)
    want = plain.score(prompts, conts, top_k=5)
    for g, w in zip(got, want, strict=True):
        assert g.error is None and g.token_ids == w.token_ids and g.prompt_tokens == w.prompt_tokens
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert [[t for t, _, _ in pos] for pos in g.top_logprobs] == [[t for t, _, _ in pos] for pos in w.top_logprobs]
        assert torch.allclose(
            torch.tensor([[v for _, _, v in p] for p in g.top_logprobs]),
            torch.tensor([[v for _, _, v in p] for p in w.top_logprobs]),
            atol=1e-4,
        )
    # metered like an API bills a prompt_logprobs request: every prompt token and every scored token
    billed = sum(w.prompt_tokens + len(c) for w, c in zip(want, conts, strict=False))
    assert cached.prefill_tokens == plain.prefill_tokens == billed
