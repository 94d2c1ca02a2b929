"""The ``teacher:`` section: which model answers the prompts, on which backend, at what price."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from campaigns.spec.common import _Strict

UNPRICED = "unpriced"  # `teacher.price: unpriced`: an API teacher whose spend is unknown


class SamplingSpec(_Strict):
    """Sampling parameters passed to every teacher backend (vLLM ``SamplingParams`` names)."""

    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(64, ge=1, le=32768, description="Completion length limit.")
    n: int = Field(1, ge=1, le=64, description="Completions per prompt.")
    seed: int = Field(0, ge=0, description="Sampling seed; with the prompt and sample index it fixes each sample.")
    logprobs: int | None = Field(
        None, ge=1, le=20, description="Store the top-k log-probabilities of each generated token (logit distillation)."
    )


class MessageSpec(_Strict):
    """One chat message."""

    role: Literal["system", "user", "assistant"] = Field(description="Who speaks.")
    content: str = Field(description="What is said.")


class TeacherSpec(_Strict):
    """The model that writes the answers the student learns from."""

    backend: Literal["transformers", "openai", "vllm"] = Field(
        "transformers",
        description="transformers: local model; openai: any OpenAI-compatible endpoint; vllm: offline batch.",
    )
    model: str = Field(
        description="The model (as `student.base_model`: a directory, `.gguf`, `@demo/<name>`, "
        "`@packaged/<name>`, `s3://`, a hub id), or the served model name for `openai`."
    )
    context: list[MessageSpec] = Field(
        default_factory=list,
        description="Messages put before every prompt the teacher answers (a system prompt, few-shot user/assistant "
        "turns): context distillation, where the student learns to answer the bare prompt as the teacher does with "
        "this context. Rendered with the teacher's chat template (`transformers`, `vllm`) or sent as chat messages "
        "(`openai` with `chat: true`); part of the generation cache key.",
    )
    context_categories: list[str] | None = Field(
        None,
        description="Put `context` only before prompts of these categories (data.category_field); the others "
        "are asked bare, so the teacher answers them as the model does without its context: replay that keeps "
        "the student's other abilities (default: every prompt gets the context).",
    )
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="`transformers` backend: dtype the local teacher generates in (auto: as "
        "`student.quantization.compute_dtype`).",
    )
    revision: str | None = Field(None, description="Model revision; part of the generation cache key.")
    sampling: SamplingSpec = SamplingSpec()
    batch_size: int = Field(64, ge=1, le=4096, description="Prompts per local generation batch.")
    base_url: str | None = Field(None, description="`openai` backend: the endpoint, e.g. http://host:8000/v1.")
    api_key_env: str | None = Field(
        None,
        description="`openai` backend: name of the environment variable holding the API key (never the key itself).",
    )
    chat: bool = Field(False, description="`openai` backend: use /v1/chat/completions instead of /v1/completions.")
    max_concurrency: int = Field(16, ge=1, le=1024, description="`openai` backend: requests in flight.")
    requests_per_minute: int | None = Field(
        None, ge=1, description="`openai` backend: client-side request rate limit (the provider's RPM quota)."
    )
    tokens_per_minute: int | None = Field(
        None, ge=1, description="`openai` backend: client-side token rate limit (prompt + max_new_tokens per request)."
    )
    request_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="`openai` backend: seconds one request may take before it is retried."
    )
    max_retries: int = Field(
        6,
        ge=0,
        le=50,
        description="`openai` backend: retries per request on 429, 5xx, timeouts (backoff, Retry-After).",
    )
    price: str | None = Field(
        None,
        description="`openai` backend (required): pricing-catalog key of the API, priced per million input and output "
        "tokens (a campaign's `cost.overrides` may change its prices); cost = tokens x price. `unpriced`: the spend "
        "is unknown, and every cost figure that depends on it says so (no budget can then cover the teacher). "
        "Self-hosted teachers are priced by `hardware` instead.",
    )
    hardware: str | None = Field(
        None,
        description="`transformers` and `vllm` backends (required): pricing-catalog key of the hardware the "
        "teacher runs on (an hourly entry; vLLM bills it x tensor_parallel_size). API teachers are priced by `price`.",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="`vllm` backend: GPUs per model (vllm.LLM tensor_parallel_size); GPU-hours count this many.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="`vllm` backend: extra vllm.LLM keyword arguments (e.g. gpu_memory_utilization, max_model_len, "
        "dtype); part of the cache key.",
    )

    @property
    def api(self) -> bool:
        """Priced per token by `price` (an endpoint), not per hour by `hardware` (self-hosted)."""
        return self.backend == "openai"

    @property
    def unpriced(self) -> bool:
        return self.api and self.price == UNPRICED

    @property
    def price_key(self) -> str | None:
        """The one pricing-catalog key that prices this teacher (None: `price: unpriced`)."""
        if self.api:
            return None if self.unpriced else self.price
        return self.hardware

    @model_validator(mode="after")
    def _openai_needs_url(self) -> TeacherSpec:
        if self.backend == "openai" and not self.base_url:
            raise ValueError("backend 'openai' needs `base_url` (e.g. http://localhost:8000/v1)")
        if self.chat and self.backend == "transformers":
            raise ValueError(
                "`chat: true` needs backend 'openai' or 'vllm' (the transformers backend renders prompts "
                "with the model's chat template when it has one)"
            )
        if self.context and self.backend == "openai" and not self.chat:
            raise ValueError(
                "`context` messages need `chat: true` with backend 'openai' (a completions endpoint takes "
                "one prompt string)"
            )
        if self.context_categories is not None and not self.context:
            raise ValueError("`context_categories` says which prompts get `context`, but there is no `context`")
        if self.context and self.context[-1].role == "user":
            raise ValueError("`context` must not end with a user message: the prompt is the next user turn")
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise ValueError(
                "`api_key_env` is the *name* of an environment variable (e.g. OPENAI_API_KEY), not the key"
            )
        return self

    @model_validator(mode="after")
    def _one_price_field(self) -> TeacherSpec:
        if self.api:
            if self.price is None:
                raise ValueError(
                    "an API teacher (backend 'openai') is priced by `price`: a pricing-catalog key priced "
                    "per million tokens (e.g. api-open-70b), or `price: unpriced` to run with its spend "
                    "unknown (every cost figure that depends on it then says so)"
                )
            if self.hardware is not None:
                raise ValueError(
                    "`hardware` prices a self-hosted teacher; an API teacher (backend 'openai') is "
                    "priced by `price` alone: remove `hardware`"
                )
        else:
            if self.hardware is None:
                raise ValueError(
                    f"a self-hosted teacher (backend {self.backend!r}) is priced by `hardware`: the "
                    "pricing-catalog key of what it runs on (e.g. cpu-2vcpu, h100-sxm)"
                )
            if self.price is not None:
                raise ValueError(
                    f"`price` prices an API teacher; a {self.backend!r} teacher is priced by `hardware` "
                    "alone: remove `price`"
                )
        return self
