"""A :class:`~campaign_orchestrator.teacher.scoring.TeacherScorer` over HTTP: any OpenAI-compatible server that
answers vLLM's ``prompt_logprobs`` (vLLM's own ``vllm serve``, or the project's teacher server,
``python -m campaign_orchestrator.teacher serve``). Against ``vllm serve`` itself (its CPU build) the scores equal
the in-process teacher's within 1e-3: tests/vllm/test_vllm_scoring_real.py.

For each (prompt, continuation) pair the teacher's prompt is rendered here, with the teacher's tokenizer and
chat template exactly as :func:`campaign_orchestrator.dataset.formatting.render_prompt_ids` renders it for
generation (its context, few-shot turns and the user turn), and ``prompt + continuation`` goes to
``POST /v1/completions`` as token ids with ``prompt_logprobs: k`` and ``max_tokens`` 1 (vLLM refuses 0; the
one generated token is billed as output, the rest as input). The server answers, per prompt position, the
log-probability of the token there and the top-k; the continuation's positions are sliced out into
:class:`~campaign_orchestrator.generation.local.Scored` rows, in input order. Pairs are sent ``batch_size`` to a
request (a list of prompts: one choice each), shortest first, ``max_concurrency`` requests in flight.

The transport is :class:`~campaign_orchestrator.generation.openai_client.OpenAICompatibleClient`'s: the same
retries (408/409/429/5xx, timeouts, dropped connections; ``Retry-After`` honoured), rate limits, and fatal
errors (a rejected key, an unknown model or URL, an unreachable endpoint: :class:`EndpointError` raises). A
request the server refuses (e.g. a pair past its context) is sent again one pair at a time, so only the pairs
that do not fit come back with ``error`` set. The API key comes from the environment variable the campaign
names (``teacher.api_key_env``); it is never logged nor put in an error.

``prefill_tokens`` counts prompt + continuation tokens of every pair the teacher scored (what an API bills as
input), ``completion_tokens`` what it generated besides (``max_tokens`` per pair, billed as output); the
ledger prices them per round (``stages.pricing.Pricing.bill(spec, "on_policy_scoring", ...)``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from campaign_orchestrator.generation.completion import Completion
from campaign_orchestrator.generation.openai_client import OpenAICompatibleClient
from campaign_orchestrator.generation.requests import GenRequest, Sampling

REFUSED = "the endpoint refused the request"  # OpenAICompatibleClient's prefix for a 400/413/422 answer


@dataclass(frozen=True)
class _ScoreRequest(GenRequest):
    """One request: the token ids of ``len(sequences)`` prompt + continuation pairs."""

    sequences: tuple[tuple[int, ...], ...] = ()


class _PromptLogprobsClient(OpenAICompatibleClient):
    """The OpenAI client's transport with a scoring body and a parser that keeps ``prompt_logprobs``."""

    def __init__(self, *args, top_k: int = 0, **kwargs):
        super().__init__(*args, chat=False, **kwargs)
        self.top_k = top_k

    def _body(self, req: GenRequest, s: Sampling) -> dict:
        assert isinstance(req, _ScoreRequest)
        seqs = [list(x) for x in req.sequences]
        return {
            "model": self.model,
            "prompt": seqs if len(seqs) > 1 else seqs[0],
            "max_tokens": s.max_new_tokens,
            "temperature": 0.0,
            "n": 1,
            "prompt_logprobs": self.top_k,
        }

    @staticmethod
    def _estimate_tokens(req: GenRequest, s: Sampling) -> int:
        return sum(len(x) + s.max_new_tokens for x in getattr(req, "sequences", ()))

    def _parse(self, data: dict, s: Sampling, latency: float, retries: int) -> Completion:
        try:
            choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
            plps = [c["prompt_logprobs"] for c in choices]
        except (KeyError, TypeError, AttributeError):
            return Completion.failed(
                "the endpoint answered without `prompt_logprobs` (it must be vLLM's "
                "OpenAI-compatible server or `python -m campaign_orchestrator.teacher serve`): "
                f"{self._redact(json.dumps(data)[:200])}",
                latency_s=latency,
                retries=retries,
            )
        usage = data.get("usage") or {}
        return Completion(
            "",
            "stop",
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
            latency,
            retries=retries,
            extra={"prompt_logprobs": plps},
        )


class HTTPTeacherScorer:
    """Score given token ids under the teacher's prompt through an OpenAI-compatible ``prompt_logprobs``
    server (see the module docstring). ``tokenizer``: the teacher's (a loaded tokenizer or its directory)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer,
        *,
        api_key: str | None = None,
        api_key_env: str | None = None,
        revision: str | None = None,
        batch_size: int = 8,
        max_tokens: int = 1,
        max_concurrency: int = 4,
        timeout_s: float = 120.0,
        max_retries: int = 6,
        requests_per_minute: float | None = None,
        tokens_per_minute: float | None = None,
        **client_kw,
    ):
        from campaign_orchestrator.generation.backends import teacher_identity

        if isinstance(tokenizer, str | Path):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.tok = tokenizer
        self.base_url, self.model = base_url.rstrip("/"), model
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self._client_args = dict(
            api_key=api_key,
            api_key_env=api_key_env,
            max_concurrency=max_concurrency,
            timeout_s=timeout_s,
            max_retries=max_retries,
            requests_per_minute=requests_per_minute,
            tokens_per_minute=tokens_per_minute,
            **client_kw,
        )
        self.identity = teacher_identity("openai", model, base_url=base_url, revision=revision)
        self.prefill_tokens = 0
        self.completion_tokens = 0
        self.requests = 0

    def __repr__(self) -> str:  # never the key
        return f"HTTPTeacherScorer({self.base_url!r}, {self.model!r})"

    @classmethod
    def from_spec(cls, teacher, tokenizer, batch_size: int = 8) -> HTTPTeacherScorer:
        """From a campaign's ``teacher:`` section (an ``openai`` backend: ``base_url``, the served ``model``,
        ``api_key_env``, timeouts, retries, concurrency and rate limits); ``tokenizer``: the teacher's (the
        directory ``training.distillation.teacher_tokenizer`` names)."""
        from campaign_orchestrator.generation.backends import read_api_key

        if not teacher.base_url:
            raise ValueError("teacher scoring over HTTP needs teacher.base_url (e.g. http://host:8000/v1)")
        return cls(
            teacher.base_url,
            teacher.model,
            tokenizer,
            api_key=read_api_key(teacher.api_key_env),
            api_key_env=teacher.api_key_env,
            revision=teacher.revision,
            batch_size=batch_size,
            max_concurrency=teacher.max_concurrency,
            timeout_s=teacher.request_timeout_s,
            max_retries=teacher.max_retries,
            requests_per_minute=teacher.requests_per_minute,
            tokens_per_minute=teacher.tokens_per_minute,
        )

    # ------------------------------------------------------------------ scoring

    def _send(self, groups: list[list[int]], seqs: list[list[int]], top_k: int) -> dict[int, Completion]:
        """Send each group of pair indexes as one request; the completion that answered each request's first pair."""
        client = _PromptLogprobsClient(self.base_url, self.model, top_k=top_k, **self._client_args)
        reqs = [
            _ScoreRequest(str(g), "", 0, 0, sequences=tuple(tuple(seqs[i]) for i in group))
            for g, group in enumerate(groups)
        ]
        answers: dict[int, Completion] = {}
        client.run(reqs, Sampling(max_new_tokens=self.max_tokens), lambda r, c: answers.__setitem__(int(r.key), c))
        self.requests += len(reqs)
        return answers

    def score(
        self, prompts: Sequence[str | Sequence[dict]], continuations: Sequence[Sequence[int]], top_k: int
    ) -> list:
        """The :class:`~campaign_orchestrator.teacher.scoring.TeacherScorer` contract: one
        :class:`~campaign_orchestrator.generation.local.Scored` per pair, in input order."""
        from campaign_orchestrator.dataset.formatting import render_prompt_ids
        from campaign_orchestrator.generation.local import Scored

        if len(prompts) != len(continuations):
            raise ValueError(
                f"score() takes one continuation per prompt: got {len(prompts)} prompts and "
                f"{len(continuations)} continuations"
            )
        enc = [render_prompt_ids(self.tok, p) for p in prompts]
        cont = [list(c) for c in continuations]
        out: list[Scored | None] = [None] * len(prompts)
        todo = []
        for i, (e, c) in enumerate(zip(enc, cont, strict=True)):
            if c:
                todo.append(i)
            else:
                out[i] = Scored([], [], [] if top_k else None, len(e))
        todo.sort(key=lambda i: len(enc[i]) + len(cont[i]))
        seqs = [enc[i] + cont[i] for i in range(len(prompts))]
        groups = [todo[s : s + self.batch_size] for s in range(0, len(todo), self.batch_size)]
        answers = self._send(groups, seqs, top_k)
        # a refused batch is sent again pair by pair: only the pairs the server cannot take fail
        alone = [
            [i]
            for g, group in enumerate(groups)
            if len(group) > 1 and not answers[g].ok and (answers[g].error or "").startswith(REFUSED)
            for i in group
        ]
        retried = self._send(alone, seqs, top_k) if alone else {}
        results: dict[int, tuple[Completion, int]] = {}
        for answered, grouping in ((answers, groups), (retried, alone)):
            for g, group in enumerate(grouping):
                for j, i in enumerate(group):
                    results[i] = (answered[g], j)
        for i in todo:
            c, j = results[i]
            out[i] = self._scored(c, j, enc[i], cont[i], top_k)
        return out  # type: ignore[return-value]

    def _scored(self, c: Completion, j: int, prompt: list[int], cont: list[int], top_k: int):
        """The ``j``-th choice of answer ``c`` as a :class:`Scored` row for ``prompt + cont``."""
        from campaign_orchestrator.generation.local import Scored

        if not c.ok:
            return Scored(cont, [], None, len(prompt), c.error)
        plps = c.extra["prompt_logprobs"]
        entries = plps[j] if j < len(plps) else None
        n = len(prompt) + len(cont)
        if not isinstance(entries, list) or len(entries) != n:
            got = len(entries) if isinstance(entries, list) else entries
            return Scored(
                cont,
                [],
                None,
                len(prompt),
                f"the endpoint's prompt_logprobs has {got} entries for a sequence of {n} tokens",
            )
        logprobs, tops = [], []
        for t, tid in enumerate(cont):
            pos = entries[len(prompt) + t] or {}
            own = pos.get(str(tid)) or pos.get(tid)
            if own is None:
                return Scored(
                    cont,
                    [],
                    None,
                    len(prompt),
                    f"the endpoint's prompt_logprobs has no entry for token {tid} at position {len(prompt) + t}",
                )
            logprobs.append(float(own["logprob"]))
            if top_k:
                ranked = sorted(
                    (
                        (int(k), float(v["logprob"]), int(v.get("rank") or 0))
                        for k, v in pos.items()
                        if v.get("rank") is not None and int(v["rank"]) <= top_k
                    ),
                    key=lambda e: (-e[1], e[2]),
                )[:top_k]
                tops.append([(tid_, None, lp) for tid_, lp, _r in ranked])
        self.prefill_tokens += n
        # what the server generated besides (max_tokens per pair); usage is per request, so count our own
        self.completion_tokens += self.max_tokens
        return Scored(list(cont), logprobs, tops if top_k else None, len(prompt))
