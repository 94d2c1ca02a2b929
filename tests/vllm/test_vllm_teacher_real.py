"""The teacher's ``vllm`` backend on vLLM's CPU build, over SmolLM2-135M-Instruct with the smollm2 campaign's teacher
(its few-shot context before the plural questions, general questions bare, top-20): it asks what the
``transformers`` teacher is asked (the same rendering) and answers the same, returns the campaign's k, vLLM's own
prefix-cache counters rise on the shared context and again on a repeat, and the dtype vLLM ran in is the one in
the cache key."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import smollm2_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _rows(n_plural: int, n_general: int) -> list[dict]:
    prompts, _ = smollm2_prompts(n_plural, n_general)
    rows = []
    for i, p in enumerate(prompts):
        plural = not isinstance(p, str)
        bare = p[-1]["content"] if plural else p
        rows.append({"id": f"r{i}", "prompt": bare, "category": "plural" if plural else "general"})
    return rows


def _cache(root, backend, sampling):
    from campaign_orchestrator.generation.blobstore import LocalStore
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.requests import namespace

    return GenerationCache(LocalStore(root / "store"), namespace(backend.identity, sampling), root / "spool")


def test_the_vllm_teacher_answers_as_transformers_with_topk_prefix_cache_and_its_dtype_in_the_key(
    smollm2, tmp_path, monkeypatch
):
    from campaign_orchestrator.generation.backends import make_backend, spec_identity
    from campaign_orchestrator.generation.requests import Sampling, build_requests
    from campaign_orchestrator.generation.runner import run_generation
    from campaign_orchestrator.hardware import resolve_compute_dtype
    from campaigns.spec import TeacherSpec

    _, teacher = smollm2_prompts(0, 0)
    k = teacher["sampling"]["logprobs"]
    base = {**teacher, "backend": "vllm", "model": str(smollm2)}
    spec = TeacherSpec.model_validate(base | {"compute_dtype": "float32"})
    # the key names the device vLLM computes on (its CPU build here) and the dtype it resolves to
    auto = spec_identity(TeacherSpec.model_validate(base), smollm2, weights_id="w")
    assert auto.endswith(f"|cpu:{resolve_compute_dtype('auto', 'cpu').dtype}")
    assert spec_identity(spec, smollm2, weights_id="w").endswith("|cpu:float32")

    from campaign_orchestrator.generation.runner import LocalExecutor

    b = make_backend(spec, smollm2, weights_id="w")
    assert b.identity == spec_identity(spec, smollm2, weights_id="w") and b.args["max_logprobs"] == k
    s = Sampling(max_new_tokens=24, logprobs=k)
    rows = _rows(10, 10)
    ctx = dict(context=teacher["context"], context_categories=teacher["context_categories"])
    try:
        # run through an executor of this test's: a bare backend would be closed when the call returns
        res = run_generation(rows, LocalExecutor(b), s, _cache(tmp_path / "v", b, s), **ctx)
        assert res.stats.generated == len(rows) and res.stats.failed == 0
        assert b.ran_dtype() == "float32" and b.stats()["compute_dtype"] == "float32"
        assert all(len(pos) == k for r in res.rows for pos in r["top_logprobs"])
        first = b.stats()
        assert first["prefix_cache_hits"] > 0, first  # the context: prefilled once, then found by the others
        # the same requests again (no generation cache in between): vLLM finds their whole prefixes
        reqs = build_requests(
            b.identity,
            s,
            [r["prompt"] for r in rows],
            context=teacher["context"],
            with_context=[r["category"] == "plural" for r in rows],
        )
        b.run([g[0] for g in reqs], s, lambda _r, _c: None)
        again = b.stats()
        assert again["prefix_cache_hits"] - first["prefix_cache_hits"] > sum(len(x) for x in teacher["context"]) // 4
    finally:
        b.close()

    # the transformers teacher over the same weights and dtype, asked the same: the same answers (on transformers'
    # generate: here auto's probe would measure vLLM too, and might answer the reference with it)
    monkeypatch.setenv("CAMPAIGN_GENERATION_ENGINE", "hf_generate")
    t = make_backend(spec.model_copy(update={"backend": "transformers"}), smollm2, weights_id="w")
    ref = run_generation(rows, t, s, _cache(tmp_path / "t", t, s), **ctx)
    same = sum(a["completion"] == r["completion"] for a, r in zip(res.rows, ref.rows, strict=True))
    assert same >= 0.95 * len(rows), [
        (a["completion"], r["completion"])
        for a, r in zip(res.rows, ref.rows, strict=True)
        if a["completion"] != r["completion"]
    ]
    assert [r["prompt_tokens"] for r in res.rows] == [r["prompt_tokens"] for r in ref.rows]
