"""Generation requests and their content-addressed keys.

A request is one sample of one prompt. Its key is the sha256 of

    (teacher identity, sampling parameters, prompt text or chat messages, sample index)

where the teacher identity names the backend and the weights (a content fingerprint of a local
checkpoint, or the endpoint and served model name, plus the revision) and, for a local transformers
teacher, what it computes in, resolved on the host (``cpu:float32``, ``cuda:bfloat16``; never ``auto``:
bf16 and fp32 answers of the same weights are not the same generations). The key does not contain
the prompt id, the campaign or ``n``: the same prompt asked of the same teacher with the same
settings is the same request in every campaign and every re-run, and raising ``n`` from 1 to 4
reuses sample 0. With greedy decoding (temperature 0) the seed and top_p do not change the
output, so they are left out of the key too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

KEY_VERSION = 1


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters shared by every backend (vLLM ``SamplingParams`` meanings)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    n: int = 1
    logprobs: int | None = None

    @classmethod
    def from_spec(cls, s: Any) -> Sampling:
        return cls(s.max_new_tokens, s.temperature, s.top_p, s.seed, s.n, s.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def key_fields(self) -> dict:
        """The parameters that change a single sample (not ``n``; not seed/top_p when greedy)."""
        d = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "logprobs": self.logprobs}
        if not self.greedy:
            d |= {"top_p": self.top_p, "seed": self.seed}
        return d

    def sample_seed(self, sample_index: int) -> int:
        return self.seed + sample_index

    def as_dict(self) -> dict:
        return asdict(self)


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def sampling_hash(sampling: Sampling) -> str:
    """The ``sampling_hash`` column: 16 hex digits of the key-relevant sampling parameters."""
    return _sha(sampling.key_fields())[:16]


def namespace(teacher_identity: str, sampling: Sampling) -> str:
    """Cache partition: all samples of one teacher with one set of sampling parameters."""
    return _sha({"v": KEY_VERSION, "teacher": teacher_identity, "sampling": sampling.key_fields()})[:24]


def request_key(teacher_identity: str, sampling: Sampling, payload: str | list[dict], sample_index: int) -> str:
    return _sha(
        {
            "v": KEY_VERSION,
            "teacher": teacher_identity,
            "sampling": sampling.key_fields(),
            "input": payload,
            "sample": sample_index,
        }
    )


@dataclass(frozen=True)
class GenRequest:
    """One sample of one prompt. ``messages`` is set for chat requests (``prompt`` then holds
    the last user turn, for display)."""

    key: str
    prompt: str
    sample_index: int
    seed: int
    messages: tuple[dict, ...] | None = None

    @property
    def payload(self) -> str | list[dict]:
        return list(self.messages) if self.messages is not None else self.prompt


def chat_messages(prompt: str, context: Sequence[dict] = ()) -> list[dict]:
    """The conversation a chat request sends: the teacher's context messages, then the prompt as a user turn."""
    return [{"role": m["role"], "content": m["content"]} for m in context] + [{"role": "user", "content": prompt}]


def build_requests(
    teacher_identity: str,
    sampling: Sampling,
    prompts: Sequence[str],
    chat: bool = False,
    context: Sequence[dict] = (),
    with_context: Sequence[bool] | None = None,
) -> list[list[GenRequest]]:
    """``result[i][s]`` is sample ``s`` of prompt ``i``. With ``context`` (``teacher.context``) a request is a
    chat request whose messages start with it; ``with_context[i]`` False asks prompt ``i`` without it."""
    out = []
    for i, p in enumerate(prompts):
        ctx = context if with_context is None or with_context[i] else ()
        msgs = tuple(chat_messages(p, ctx)) if chat or ctx else None
        payload: str | list[dict] = list(msgs) if msgs is not None else p
        out.append(
            [
                GenRequest(request_key(teacher_identity, sampling, payload, s), p, s, sampling.sample_seed(s), msgs)
                for s in range(sampling.n)
            ]
        )
    return out
