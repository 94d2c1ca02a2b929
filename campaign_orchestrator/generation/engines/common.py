"""What every local engine does alike: the prompts that do not fit, and a finished row as a Completion."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from campaign_orchestrator.generation.completion import Completion

GROUP_PREFIX_MIN_TOKENS = 8  # continuous engine: prompts sharing at least this many first tokens share one prefill


def too_long(prompt_len: int, max_new_tokens: int, context_length: int | None) -> bool:
    return bool(context_length) and prompt_len + max_new_tokens > context_length


def skip_too_long(
    enc: Sequence[list[int]],
    max_new_tokens: int,
    context_length: int | None,
    out: list,
    on_result: Callable[[int, Completion], None] | None,
    progress: Callable[[int], None] | None = None,
) -> list[int]:
    """Fill ``out`` with an error for each prompt that does not fit the context (counted to ``progress``); returns
    the others' indexes."""
    fits = []
    for i, e in enumerate(enc):
        if too_long(len(e), max_new_tokens, context_length):
            out[i] = Completion.failed(
                f"prompt of {len(e)} tokens + {max_new_tokens} new tokens exceeds the "
                f"teacher's context of {context_length}",
                len(e),
            )
            if on_result:
                on_result(i, out[i])
        else:
            fits.append(i)
    if progress and len(fits) < len(enc):
        progress(len(enc) - len(fits))
    return fits


def finished(tok, stops: set[int], toks: list[int], prompt_len: int, latency: float, top=None) -> Completion:
    """A row's completion from its generated ids (``toks``: up to and including a stop id, if one came)."""
    stopped = bool(toks) and toks[-1] in stops
    text = tok.decode(toks[:-1] if stopped else toks, skip_special_tokens=True)
    return Completion(
        text, "stop" if stopped else "length", prompt_len, len(toks), latency, top_logprobs=top, token_ids=list(toks)
    )


def cut_at_stop(toks: list[int], stops: set[int], max_new_tokens: int) -> list[int]:
    """Generated ids up to and including the first stop id (at most ``max_new_tokens``)."""
    toks = list(toks[:max_new_tokens])
    end = next((j for j, t in enumerate(toks) if t in stops), None)
    return toks if end is None else toks[: end + 1]


def prefix_groups(seqs: Sequence[list[int]], min_tokens: int = GROUP_PREFIX_MIN_TOKENS) -> list[tuple[list[int], int]]:
    """Indexes of ``seqs`` grouped by a shared prefix: ``[(indexes, prefix_length)]``. Sequences are
    sorted by their tokens; neighbours that share at least ``min_tokens`` first tokens join a group
    whose prefix is what all its members share (each keeps a token of its own). Sequences in no such
    group come back together with prefix 0, last."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and shared_prefix_length([seqs[groups[-1][-1]], seqs[i]]) >= min_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    out, rest = [], []
    for g in groups:
        if len(g) < 2:
            rest += g
            continue
        out.append((g, shared_prefix_length([seqs[i] for i in g])))
    if rest:
        out.append((rest, 0))
    return out


def shared_prefix_length(seqs: Sequence[list[int]]) -> int:
    """Tokens every sequence starts with (at most the shortest minus one: each keeps a token of its own)."""
    if len(seqs) < 2:
        return 0
    first, limit = seqs[0], min(len(s) for s in seqs) - 1
    n = 0
    while n < limit and all(s[n] == first[n] for s in seqs):
        n += 1
    return n
