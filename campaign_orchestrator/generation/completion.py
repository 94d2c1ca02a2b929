"""What every teacher backend returns for one request. Pure Python (no torch, no HTTP)."""

from __future__ import annotations

from dataclasses import dataclass, field

# One inner list per generated token; each entry is (token_id, token, logprob). Local backends
# (transformers, vllm) fill token_id; HTTP backends only know the token's text. See rows.py.
TopLogprobs = list[list[tuple[int | None, str | None, float]]]


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" (EOS / stop sequence), "length" (hit max_new_tokens) or "error"
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_s: float
    error: str | None = None
    top_logprobs: TopLogprobs | None = None
    token_ids: list[int] | None = None  # generated token ids (local backends), stop token included
    # the generated tokens' text (HTTP backends with top-k: one per top-k list, stop token included when the API
    # lists it; a token that is not whole UTF-8 as campaign_orchestrator.dataset.xtok.token_string writes it)
    token_strings: list[str] | None = None
    retries: int = 0  # HTTP attempts beyond the first (rate limits, 5xx, timeouts)
    extra: dict = field(default_factory=dict)

    @classmethod
    def failed(
        cls, error: str, prompt_tokens: int | None = None, latency_s: float = 0.0, retries: int = 0
    ) -> Completion:
        return cls("", "error", prompt_tokens, 0, latency_s, error=error, retries=retries)

    @property
    def ok(self) -> bool:
        return self.error is None
