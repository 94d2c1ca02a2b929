"""Teacher scoring: the teacher's judgement of given text, one prefill per sequence, no generation.

On-policy distillation (issue 26) samples completions from the *student* and asks the teacher for its
top-k log-probabilities at every completion position. A :class:`TeacherScorer` answers that, wherever
the teacher runs:

- in process, beside the student: a :class:`~campaign_orchestrator.generation.local.LocalModel` and its
  :meth:`~campaign_orchestrator.generation.local.LocalModel.score` (one forward pass per batch);
- behind an OpenAI-compatible server that returns ``prompt_logprobs`` (vLLM's extra request field; the
  project's own local teacher server answers the same field), over HTTP.

The contract, shared by both:

``score(prompts, continuations, top_k) -> list[Scored]``
    ``prompts[i]`` is what the *teacher* is asked (a string, or chat messages: its context, few-shot
    turns and the user turn), rendered with the teacher's chat template exactly as for generation;
    ``continuations[i]`` are token ids (the student's sample; teacher and student vocabularies are the
    same, checked before training). Each :class:`~campaign_orchestrator.generation.local.Scored` carries, per
    continuation token, the teacher's log-probability of that token and its top-``top_k`` ``(id, None,
    logprob)`` entries, and ``prompt_tokens`` (the rendered prompt's length). Results in input order; a
    pair that does not fit the teacher's context comes back with ``error`` set.

``prefill_tokens``
    Tokens this scorer has asked the teacher to prefill so far (prompt + continuation, every call): what
    an API teacher bills as input tokens and the ledger records per round.

``identity``
    What makes two teachers the same (:func:`campaign_orchestrator.generation.backends.teacher_identity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch-free at import
    from campaign_orchestrator.generation.local import Scored


class TeacherScorer(Protocol):
    identity: str
    prefill_tokens: int

    def score(
        self, prompts: Sequence[str | Sequence[dict]], continuations: Sequence[Sequence[int]], top_k: int
    ) -> list[Scored]: ...
