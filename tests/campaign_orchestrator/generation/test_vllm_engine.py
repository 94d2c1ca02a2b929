"""vLLM as a GPU engine, against a stand-in with ``vllm.LLM``'s offline interface (its constructor, ``generate``
with token-id prompts, ``SamplingParams`` and ``LoRARequest``) that answers with the demo models through
transformers: the candidate's adapter goes to vLLM as a LoRA request (enable_lora, max_lora_rank from the adapter
config), prefix caching is on, ``max_logprobs`` follows the top-k asked for, and the resolved dtype is in the
teacher's cache key. These check the arguments the project builds, without vLLM; the real engine (vLLM's CPU
build, in .venv-vllm) is tested in tests/vllm/ (`make test-heavy`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from campaign_orchestrator.demo import cipher

WORDS = ["ab", "abcdefgh", "xy", "qrstuvwx", "hello", "z"]


@dataclass
class SamplingParams:
    """vllm.SamplingParams' field names (an unknown keyword raises TypeError, like vLLM)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = 16
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: list = field(default_factory=list)


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class StandInLLM:
    """``vllm.LLM(**engine_args)``: loads ``model`` through transformers (fp32, CPU); a request with a
    ``LoRARequest`` answers with that adapter on the base, as vLLM's LoRA serving does. Refuses what vLLM
    refuses: more top-k than ``max_logprobs``, a LoRA request without ``enable_lora`` or above ``max_lora_rank``."""

    started: list[StandInLLM] = []

    def __init__(self, **kwargs):
        from campaign_orchestrator.generation.local import LocalModel

        self.kwargs, self.calls = kwargs, []
        self.base = LocalModel.from_path(kwargs["model"], compute_dtype="float32", device="cpu", engine="hf_generate")
        self.adapters: dict = {}
        StandInLLM.started.append(self)

    def _gen(self, lora):
        from campaign_orchestrator.generation.engines.vllm_engine import lora_rank
        from campaign_orchestrator.generation.local import LocalModel

        if lora is None:
            return self.base
        assert self.kwargs.get("enable_lora"), "vLLM: LoRA requests need enable_lora=True"
        assert lora_rank(lora.lora_path) <= self.kwargs["max_lora_rank"]
        if lora.lora_path not in self.adapters:
            self.adapters[lora.lora_path] = LocalModel.from_path(
                self.kwargs["model"], lora.lora_path, compute_dtype="float32", device="cpu", engine="hf_generate"
            )
        return self.adapters[lora.lora_path]

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
        sp = sampling_params
        assert not use_tqdm and sp.temperature == 0.0
        if sp.logprobs and sp.logprobs > self.kwargs.get("max_logprobs", 20):
            raise ValueError(f"Requested sample logprobs of {sp.logprobs}, which is greater than max allowed")
        self.calls.append((prompts, sp, lora_request))
        gen = self._gen(lora_request)
        ids = [p["prompt_token_ids"] for p in prompts]
        res = gen.engine_instance("hf_generate").generate(ids, sp.max_tokens, sp.logprobs)
        out = []
        for p, c in zip(ids, res, strict=True):
            lps = None
            if sp.logprobs:
                lps = [{e[0]: Logprob(e[2], r + 1) for r, e in enumerate(pos)} for pos in c.top_logprobs]
            co = SimpleNamespace(
                text=c.text, token_ids=tuple(c.token_ids), finish_reason=c.finish_reason, logprobs=lps, stop_reason=None
            )
            out.append(SimpleNamespace(prompt_token_ids=p, outputs=[co]))
        return out


@pytest.fixture(scope="module")
def adapter(demo_models, tmp_path_factory):
    """A LoRA adapter (rank 4, random B: it changes the student's answers) on the demo student."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("adapter")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(demo_models["student"]))
    peft = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft.save_pretrained(str(out))
    return out


@pytest.mark.stage
def test_candidate_answers_go_through_a_lora_request(demo_models, adapter):
    from campaign_orchestrator.generation.engines.vllm_engine import VLLMEngine
    from campaign_orchestrator.generation.local import LocalModel

    StandInLLM.started.clear()
    cand = LocalModel.from_path(
        demo_models["student"], adapter, compute_dtype="float32", device="cpu", engine="vllm", batch_size=4
    )
    cand.engines["vllm"] = VLLMEngine(cand, StandInLLM, SamplingParams, LoRARequest)
    prompts = [cipher.prompt_for(w) for w in WORDS]
    got = cand.generate(prompts, 16, logprobs=3)
    assert cand.last_engine == "vllm"
    (llm,) = StandInLLM.started
    kw = llm.kwargs
    assert kw["model"] == str(demo_models["student"])  # the base: the adapter is never merged for vLLM
    assert kw["enable_lora"] and kw["max_lora_rank"] == 8 and kw["max_loras"] == 1  # r=4 -> vLLM's smallest rank
    assert kw["enable_prefix_caching"] and kw["max_logprobs"] == 3 and kw["dtype"] == "float32"
    ((_prompts, sp, lora),) = llm.calls
    assert lora == LoRARequest("adapter", 1, str(adapter)) and sp.stop_token_ids == cand.stop_ids
    # the same answers as transformers with the adapter merged, and not the base's
    cand.engine = "hf_generate"
    ref = cand.generate(prompts, 16, logprobs=3)
    assert [(c.text, c.token_ids, c.finish_reason) for c in got] == [
        (c.text, c.token_ids, c.finish_reason) for c in ref
    ]
    assert [[[e[0] for e in pos] for pos in c.top_logprobs] for c in got] == [
        [[e[0] for e in pos] for pos in c.top_logprobs] for c in ref
    ]
    base = llm.base.generate(prompts, 16)
    assert [c.token_ids for c in base] != [c.token_ids for c in got]
    # more top-k than the engine was started with: it restarts with max_logprobs matched to the request
    cand.engine = "vllm"
    cand.generate(prompts[:2], 8, logprobs=5)
    assert len(StandInLLM.started) == 2 and StandInLLM.started[-1].kwargs["max_logprobs"] == 5


def test_the_vllm_teachers_key_holds_its_resolved_dtype(demo_models):
    from campaign_orchestrator.generation.backends import spec_identity
    from campaign_orchestrator.generation.engines.vllm_engine import VLLMEngine, resolve_dtype

    def spec(**kw):
        return SimpleNamespace(
            backend="vllm",
            model="@demo/teacher",
            revision=None,
            base_url=None,
            compute_dtype=kw.pop("compute_dtype", "auto"),
            engine_args=kw,
        )

    path = demo_models["teacher"]  # config.json says float32: vLLM's auto runs it in float16
    assert resolve_dtype(path, "auto") == "float16" and resolve_dtype(path, "bfloat16") == "bfloat16"
    auto = spec_identity(spec(), path, weights_id="w")
    assert auto.endswith("|cuda:float16")
    assert spec_identity(spec(compute_dtype="bfloat16"), path, weights_id="w").endswith("|cuda:bfloat16")
    assert spec_identity(spec(dtype="float16"), path, weights_id="w") != auto  # engine_args differ too
    assert spec_identity(spec(compute_dtype="float16"), path, weights_id="w") == auto  # what auto resolves to
    b = VLLMEngine(llm_class=StandInLLM, params_class=SamplingParams, model=str(path), top_k=4)
    assert b.identity.endswith("|cuda:float16") and b.dtype == "float16"


@pytest.mark.stage
def test_the_vllm_teacher_starts_with_prefix_caching_its_dtype_and_the_campaigns_top_k(demo_models, tmp_path):
    from campaign_orchestrator.generation.blobstore import LocalStore
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.engines.vllm_engine import VLLMEngine
    from campaign_orchestrator.generation.requests import Sampling, namespace
    from campaign_orchestrator.generation.runner import run_generation

    class GenerateOnly(StandInLLM):  # the backend sends rendered token ids with one SamplingParams per prompt
        def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None):
            from campaign_orchestrator.dataset.formatting import render_prompt_ids

            assert [p["prompt_token_ids"] for p in prompts] == [
                render_prompt_ids(self.base.tok, cipher.prompt_for(w)) for w in WORDS[: len(prompts)]
            ]
            sp = sampling_params[0] if isinstance(sampling_params, list) else sampling_params  # greedy: all alike
            return super().generate(
                prompts,
                SamplingParams(**{**sp.__dict__, "stop_token_ids": self.base.stop_ids}),
                use_tqdm=use_tqdm,
                lora_request=lora_request,
            )

    StandInLLM.started.clear()
    s = Sampling(max_new_tokens=16, logprobs=4)
    b = VLLMEngine(llm_class=GenerateOnly, params_class=SamplingParams, model=str(demo_models["teacher"]), top_k=4)
    cache = GenerationCache(LocalStore(tmp_path / "c"), namespace(b.identity, s), tmp_path / "spool")
    res = run_generation([{"id": w, "prompt": cipher.prompt_for(w)} for w in WORDS[:3]], b, s, cache)
    assert res.stats.generated == 3 and all(len(pos) == 4 for r in res.rows for pos in r["top_logprobs"])
    kw = StandInLLM.started[-1].kwargs
    assert kw["enable_prefix_caching"] and kw["max_logprobs"] == 4 and kw["dtype"] == "float16"
    assert "enable_lora" not in kw
