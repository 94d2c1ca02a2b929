"""The transformers and vLLM backends on the real demo teacher (vLLM, :class:`VLLMEngine` in its backend role, through
an injected object with ``vllm.LLM``'s offline interface, backed by the same checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from campaign_orchestrator.demo import cipher
from campaign_orchestrator.generation.backends import BackendError, TransformersBackend, teacher_identity
from campaign_orchestrator.generation.blobstore import LocalStore
from campaign_orchestrator.generation.cache import GenerationCache
from campaign_orchestrator.generation.engines.vllm_engine import VLLMEngine
from campaign_orchestrator.generation.requests import GenRequest, Sampling, namespace
from campaign_orchestrator.generation.runner import run_generation

ITEMS = cipher.items(12, seed=123, id_prefix="t")
PROMPTS = [{"id": it["id"], "prompt": it["prompt"]} for it in ITEMS]
TOO_LONG = {"id": "long", "prompt": "encode " + "abcdefgh" * 8 + " ="}  # > 64 positions with 16 new tokens


@pytest.fixture(scope="module")
def teacher_gen(demo_models):
    from campaign_orchestrator.generation.local import LocalModel

    return LocalModel.from_path(demo_models["teacher"], batch_size=8)


def _cache(tmp_path, identity, sampling):
    return GenerationCache(LocalStore(tmp_path / "cache"), namespace(identity, sampling), tmp_path / "spool")


def _check_logprobs(row: dict, k: int) -> None:
    top, ids = row["top_logprobs"], row["completion_token_ids"]
    assert len(top) == len(ids) == row["completion_tokens"]
    for pos, tid in zip(top, ids, strict=True):
        assert len(pos) == k
        lps = [e[2] if isinstance(e, tuple) else e["logprob"] for e in pos]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        first = pos[0][0] if isinstance(pos[0], tuple) else pos[0]["token_id"]
        assert first == tid  # greedy: the generated token is the most likely one


def test_batched_generation_matches_one_at_a_time(teacher_gen):
    prompts = [p["prompt"] for p in PROMPTS[:4]]
    batched = teacher_gen.generate(prompts, 16)
    single = [teacher_gen.generate([p], 16)[0] for p in prompts]
    assert [c.text for c in batched] == [c.text for c in single]  # left padding and bucketing change nothing
    assert sum(c.text.strip() == it["reference"] for c, it in zip(batched, ITEMS, strict=False)) >= 3


def test_device_is_the_gpu_when_torch_sees_one(monkeypatch):
    import torch

    from campaign_orchestrator.generation.local import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nothing is moved: only the choice
    assert default_device() == "cuda"


def test_inputs_go_to_the_model_device(monkeypatch, demo_models, teacher_gen):
    import torch

    from campaign_orchestrator.generation.local import LocalModel, default_device, load_model

    assert teacher_gen.device.type == default_device()
    seen = []
    real = teacher_gen.model.generate

    def spy(input_ids, attention_mask, **kw):
        seen.append((input_ids.device, attention_mask.device))
        return real(input_ids=input_ids, attention_mask=attention_mask, **kw)

    monkeypatch.setattr(teacher_gen.model, "generate", spy)
    monkeypatch.setattr(teacher_gen, "setting", "hf_generate")
    out = teacher_gen.generate([p["prompt"] for p in PROMPTS[:3]], 8, logprobs=2)
    assert seen == [(teacher_gen.device, teacher_gen.device)]
    assert all(c.token_ids and c.top_logprobs for c in out)  # results back as plain Python values
    # the continuous engine calls the model's forward: its inputs are on the model's device too
    monkeypatch.setattr(teacher_gen, "setting", "continuous")
    fwd = []
    hook = teacher_gen.model.register_forward_pre_hook(
        lambda m, a, kw: fwd.append({k: v.device for k, v in kw.items() if isinstance(v, torch.Tensor)}),
        with_kwargs=True,
    )
    try:
        out = teacher_gen.generate([p["prompt"] for p in PROMPTS[:3]], 8, logprobs=2)
    finally:
        hook.remove()
    assert len(seen) == 1 and fwd and all(d == teacher_gen.device for f in fwd for d in f.values())
    assert all(c.token_ids and c.top_logprobs for c in out)

    pad = teacher_gen.tok.pad_token_id
    ids, mask = teacher_gen._batch_inputs([[5, 6, 7], [8]], 3)
    assert ids.device == mask.device == teacher_gen.device
    assert ids.tolist() == [[5, 6, 7], [pad, pad, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    # load_model puts the model where asked and the inputs follow it; the meta device (shapes, no
    # data) stands in for a GPU here
    model, tok, precision = load_model(demo_models["teacher"], device="meta")
    assert precision.dtype in ("float32", "bfloat16")  # compute_dtype auto, resolved for the device
    on_meta = LocalModel(model, tok)
    assert on_meta.device == torch.device("meta") and not model.training
    ids, mask = on_meta._batch_inputs([[5, 6, 7], [8]], 3)
    assert ids.device == mask.device == torch.device("meta") and ids.shape == (2, 3)


def test_transformers_backend_rows_logprobs_skip_and_cache(tmp_path, demo_models, teacher_gen):
    s = Sampling(max_new_tokens=16, logprobs=3)
    ident = teacher_identity("transformers", "@demo/teacher", demo_models["teacher"])
    backend = TransformersBackend(demo_models["teacher"], "@demo/teacher", ident, local_model=teacher_gen)
    res = run_generation(PROMPTS + [TOO_LONG], backend, s, _cache(tmp_path, ident, s))
    rows = {r["id"]: r for r in res.rows}
    assert res.stats.generated == len(PROMPTS) and res.stats.failed == 1
    assert rows["long"]["finish_reason"] == "error" and "exceeds the teacher's context" in rows["long"]["error"]
    good = [rows[it["id"]] for it in ITEMS]
    assert sum(r["completion"].strip() == it["reference"] for r, it in zip(good, ITEMS, strict=True)) >= len(ITEMS) - 1
    for r in good:
        assert r["finish_reason"] == "stop" and r["backend"] == "transformers" and r["prompt_tokens"] > 0
        _check_logprobs(r, 3)
    assert res.stats.tokens_per_s > 0 and res.stats.generate_s > 0

    class MustNotLoad:
        def generate(self, *a, **k):
            raise AssertionError("the model was asked although everything is cached")

    again = TransformersBackend(demo_models["teacher"], "@demo/teacher", ident, local_model=MustNotLoad())
    res2 = run_generation(PROMPTS, again, s, _cache(tmp_path, ident, s))
    assert res2.stats.cache_hits == len(PROMPTS) and res2.stats.generated == 0
    assert [r["completion"] for r in res2.rows] == [r["completion"] for r in good]
    assert all(r["from_cache"] for r in res2.rows)


@pytest.mark.stage
def test_sampling_n_samples_per_prompt(tmp_path, demo_models, teacher_gen):
    s = Sampling(max_new_tokens=16, temperature=1.0, n=3, seed=5)
    ident = "transformers:test"
    backend = TransformersBackend(demo_models["teacher"], "@demo/teacher", ident, local_model=teacher_gen)
    res = run_generation(PROMPTS[:4], backend, s, _cache(tmp_path, ident, s))
    assert len(res.rows) == 12 and [r["sample_index"] for r in res.rows[:3]] == [0, 1, 2]
    assert len({r["request_key"] for r in res.rows}) == 12
    # raising n later reuses the samples already made
    s4 = Sampling(max_new_tokens=16, temperature=1.0, n=4, seed=5)
    res4 = run_generation(PROMPTS[:4], backend, s4, _cache(tmp_path, ident, s4))
    assert res4.stats.cache_hits == 12 and res4.stats.generated == 4


# --------------------------------------------------------------------------- vLLM's interface


@dataclass
class FakeSamplingParams:
    """vllm.SamplingParams' field names (an unknown keyword raises TypeError, like vLLM)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = 16
    seed: int | None = None
    logprobs: int | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FakeLLM:
    """``vllm.LLM``'s offline interface (generate, get_tokenizer, llm_engine.model_config),
    answering with the demo teacher through transformers."""

    def __init__(self, gen, max_model_len: int | None = 64):
        self.gen, self.max_model_len = gen, max_model_len
        self.calls: list[list[FakeSamplingParams]] = []
        if max_model_len is not None:
            self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len))

    def get_tokenizer(self):
        return self.gen.tok

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        assert len(params) == len(prompts) and not use_tqdm
        enc = [list(p["prompt_token_ids"]) for p in prompts]  # the backend sends rendered token ids
        for ids in enc:
            n = len(ids)
            if n >= 64:
                raise ValueError(f"The decoder prompt (length {n}) is longer than the maximum model length of 64.")
        self.calls.append(list(params))
        groups: dict = {}  # one batched transformers call per distinct SamplingParams
        for i, sp in enumerate(params):
            groups.setdefault(repr(sp), (sp, []))[1].append(i)
        comps: dict[int, list] = {}
        for sp, idx in groups.values():
            flat = [enc[i] for i in idx for _ in range(sp.n)]
            hf = self.gen.engine_instance("hf_generate")
            kw = {"temperature": sp.temperature, "top_p": sp.top_p, "seed": sp.seed or 0} if sp.temperature else {}
            res = hf.generate(flat, sp.max_tokens, sp.logprobs, **kw)
            for j, i in enumerate(idx):
                comps[i] = res[j * sp.n : (j + 1) * sp.n]
        out = []
        for i, sp in enumerate(params):
            outputs = []
            for j, c in enumerate(comps[i]):
                lps = None
                if sp.logprobs:
                    lps = []
                    for pos, tid in zip(c.top_logprobs, c.token_ids, strict=True):
                        d = {e[0]: Logprob(e[2], r + 1, self.gen.tok.decode([e[0]])) for r, e in enumerate(pos)}
                        d.setdefault(tid, Logprob(-30.0, 999, "?"))  # vLLM adds the sampled token when outside top-k
                        lps.append(d)
                outputs.append(
                    SimpleNamespace(
                        index=j, text=c.text, token_ids=tuple(c.token_ids), finish_reason=c.finish_reason, logprobs=lps
                    )
                )
            out.append(SimpleNamespace(prompt=None, prompt_token_ids=enc[i], outputs=outputs))
        return out


@pytest.mark.stage
def test_vllm_backend_with_injected_llm(tmp_path, teacher_gen):
    llm = FakeLLM(teacher_gen)
    s = Sampling(max_new_tokens=16, logprobs=2)
    backend = VLLMEngine(
        model="@demo/teacher", identity="vllm:test", llm=llm, params_class=FakeSamplingParams, chunk_size=5
    )
    res = run_generation(PROMPTS + [TOO_LONG], backend, s, _cache(tmp_path, "vllm:test", s))
    assert [len(c) for c in llm.calls] == [5, 5, 2]  # chunks: each reaches the cache before the next
    sp = llm.calls[0][0]
    assert (sp.n, sp.temperature, sp.max_tokens, sp.logprobs, sp.seed) == (1, 0.0, 16, 2, None)
    rows = {r["id"]: r for r in res.rows}
    assert "max_model_len 64" in rows["long"]["error"] and res.stats.failed == 1  # skipped before vLLM
    direct = teacher_gen.generate([p["prompt"] for p in PROMPTS], 16)
    assert [rows[p["id"]]["completion"] for p in PROMPTS] == [c.text for c in direct]
    for p in PROMPTS:
        _check_logprobs(rows[p["id"]], 2)  # the sampled token beyond top-k is cut: k entries per position
        assert rows[p["id"]]["backend"] == "vllm"


@pytest.mark.stage
def test_vllm_backend_sends_n_once_per_prompt_and_isolates_rejected_prompts(tmp_path, teacher_gen):
    llm = FakeLLM(teacher_gen, max_model_len=None)  # no config to pre-check lengths: vLLM's ValueError is handled
    s = Sampling(max_new_tokens=16, temperature=1.0, n=3, seed=11)
    backend = VLLMEngine(model="@demo/teacher", identity="vllm:n", llm=llm, params_class=FakeSamplingParams)
    res = run_generation(PROMPTS[:4] + [TOO_LONG], backend, s, _cache(tmp_path, "vllm:n", s))
    assert res.stats.generated == 12 and res.stats.failed == 3
    ok_calls = [c for c in llm.calls if all(p.n == 3 for p in c)]
    assert ok_calls and all(p.seed == 11 for c in ok_calls for p in c)
    assert all("vLLM rejected the prompt" in r["error"] for r in res.rows if r["id"] == "long")


def test_vllm_missing_package_is_a_clear_error():
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed here")
    except ImportError:
        pass
    backend = VLLMEngine(model="some/model")  # cheap: nothing loads until a request comes
    with pytest.raises(BackendError, match=r"pip install '\.\[vllm\]'"):
        backend.run([GenRequest("k", "p", 0, 0)], Sampling(), lambda r, c: None)


def test_the_old_vllm_backend_name_warns_and_builds_the_same_engine():
    """``VLLMBackend`` (the teacher's vLLM class before issue 44) still imports, with a FutureWarning, and its old
    call builds the one vLLM class with the identity and engine arguments it had: these values are what
    ``VLLMBackend`` computed on main at 845e7fa, so no vLLM teacher's generations are keyed anew."""
    import campaign_orchestrator.generation.backends as backends

    with pytest.warns(FutureWarning, match=r"VLLMBackend is now VLLMEngine"):
        old = backends.VLLMBackend
    with pytest.warns(FutureWarning):
        from campaign_orchestrator.generation.backends import VLLMBackend  # noqa: F401 - the import itself warns
    extra = {"max_model_len": 256, "dtype": "bfloat16"}
    b = old("org/teacher", revision="r1", engine_args=extra, top_k=5, seed=3, tensor_parallel_size=2, chunk_size=7)
    assert isinstance(b, VLLMEngine) and b.chunk_size == 7 and b.llm is None  # nothing starts until a request
    assert b.identity == "vllm:name:org/teacher@r1|8945647b49fc|cuda:bfloat16"
    assert b.args == {
        "model": "org/teacher",
        "revision": "r1",
        "tensor_parallel_size": 2,
        "seed": 3,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        "dtype": "bfloat16",
        "max_logprobs": 5,
        "max_model_len": 256,
    }
    new = VLLMEngine(model="org/teacher", revision="r1", extra_args=extra, top_k=5, seed=3, tensor_parallel_size=2)
    assert (new.identity, new.args) == (b.identity, b.args)
    with pytest.raises(AttributeError, match="NoSuchBackend"):
        backends.NoSuchBackend  # noqa: B018 - only the old name is forwarded


def test_identity_tracks_weights_and_revision(demo_models):
    a = teacher_identity("transformers", "@demo/teacher", demo_models["teacher"], "r1")
    assert a == teacher_identity("transformers", "elsewhere", demo_models["teacher"], "r1")  # content, not name
    assert a != teacher_identity("transformers", "@demo/teacher", demo_models["teacher"], "r2")
    assert a != teacher_identity("transformers", "@demo/student", demo_models["student"], "r1")
    assert teacher_identity("openai", "m", base_url="http://h/v1/") == teacher_identity(
        "openai", "m", base_url="http://h/v1"
    )
