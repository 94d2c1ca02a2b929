"""The ``teacher:`` section: which model answers the prompts, on which backend, at what price."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from campaigns.spec.common import SLUG, _Strict

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


# --------------------------------------------------------------------------- several teachers

ROUTING_FIELDS = frozenset({"name", "categories", "budget_share"})  # what a list entry adds to a teacher section
SINGLE_NAME = "teacher"  # the one teacher of a `teacher:` mapping, where every teacher has a name


class TeacherEntry(TeacherSpec):
    """One teacher of a list (``teacher:`` as a list): a teacher section of its own (backend, model, price or
    hardware, sampling, ...) plus its name, the categories it answers and its share of the budget."""

    name: str = Field(
        description="Slug naming the teacher (lowercase letters, digits, '_'): the distillation set's `teacher` "
        "column, its cost lines in the ledger and the cost report, its budget stop."
    )
    categories: list[str] | None = Field(
        None,
        description="The prompt categories (data.category_field) this teacher answers, for training, evaluation "
        "and replay alike. Exactly one entry leaves it unset: the default teacher, which answers every other "
        "prompt (and prompts without a category).",
    )
    budget_share: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="The largest share of the teacher budget (cost.stage_budgets_usd.teacher_generations, else "
        "cost.budget_usd) this teacher may spend in teacher_generations; past it the teacher is stopped and the "
        'others go on (docs/teacher.md, "Several teachers"). Unset: only the campaign\'s budgets apply.',
    )

    @field_validator("categories")
    @classmethod
    def _routes_something(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v:
            raise ValueError(
                "`categories: []` routes no prompt to this teacher: list its categories, or remove `categories` "
                "to make it the default teacher (it answers every prompt no other teacher lists)"
            )
        return v

    @model_validator(mode="after")
    def _named(self) -> TeacherEntry:
        if not SLUG.match(self.name):
            raise ValueError(
                f"`name` must be a slug (lowercase letter first, then lowercase letters, digits or '_'), "
                f"got {self.name!r}"
            )
        return self

    def section(self) -> TeacherSpec:
        """This teacher as a plain ``teacher:`` section (what the backends, the cache and the prices read)."""
        return TeacherSpec.model_validate(self.model_dump(exclude=set(ROUTING_FIELDS)))

    @property
    def is_default(self) -> bool:
        return self.categories is None


class TeacherList(TeacherSpec):
    """Several teachers, routed by category (``teacher:`` written as a list of :class:`TeacherEntry`). Its own
    fields are the default entry's, so what reads the teacher's settings alone (a replay's teacher, the model
    card's lineage) reads the default teacher; ``entries`` holds every teacher in the file's order."""

    entries: tuple[TeacherEntry, ...]

    @classmethod
    def of(cls, entries: list[TeacherEntry]) -> TeacherList:
        """The list as written, checked: names unique, exactly one default entry, each category routed once."""
        problems = []
        names = [e.name for e in entries]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            problems.append(f"teacher names must be unique: {', '.join(twice)} named twice")
        defaults = [f"teacher[{i}] ({e.name})" for i, e in enumerate(entries) if e.is_default]
        if len(defaults) != 1:
            problems.append(
                "exactly one teacher of the list leaves `categories` unset (the default teacher: it answers every "
                "prompt the others do not list); "
                + (
                    "every entry lists categories: remove `categories` from the one that should answer the rest"
                    if not defaults
                    else f"{' and '.join(defaults)} both do: give all but one their `categories`"
                )
            )
        owner: dict[str, str] = {}
        for e in entries:
            for c in e.categories or []:
                if c in owner and owner[c] != e.name:
                    problems.append(
                        f"category {c!r} is routed to two teachers ({owner[c]} and {e.name}): keep it in one"
                    )
                owner.setdefault(c, e.name)
        if problems:
            raise ValueError("; ".join(problems))
        default = next(e for e in entries if e.is_default)
        return cls.model_validate(default.section().model_dump() | {"entries": tuple(entries)})

    @property
    def default(self) -> TeacherEntry:
        return next(e for e in self.entries if e.is_default)

    def for_category(self, category: str | None) -> TeacherEntry:
        """The teacher that answers a prompt of ``category`` (the default one when no entry lists it)."""
        for e in self.entries:
            if e.categories is not None and category in e.categories:
                return e
        return self.default
