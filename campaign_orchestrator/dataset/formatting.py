"""Render examples with the student's template and tokenize them with exact loss masks.

Two input forms (TRL's conventional dataset formats):

* **prompt/completion**: string columns ``prompt`` and ``completion``.
* **conversational**: a ``messages`` column, a list of ``{"role", "content"}`` with at least
  one ``assistant`` message.

Two templates:

* **chat**: the tokenizer's own chat template (``apply_chat_template``). A pair becomes
  ``[user: prompt, assistant: completion]``. Each assistant turn is the text the template adds
  between the prompt rendered with ``add_generation_prompt=True`` and the conversation
  rendered through that turn; a template that does not render prefixes consistently is an error.
* **plain** (tokenizer without a chat template): ``[bos] prompt completion [eos]``, with BOS
  only when the tokenizer adds it to a bare prompt at inference (probed once), so training
  sees exactly the prompt tokens that generation will see. Conversations in plain mode must be
  one exchange (optional system, one user, one assistant); longer ones are counted drops.

Prompt and completion text are tokenized separately and concatenated, as at inference (the
prompt is encoded alone, the model writes the rest). **EOS** is explicit: the tokenizer's EOS is
appended after the last assistant turn unless that turn already contains it (a chat template
that ends turns with EOS, or a completion that ends with it). Labels are the token ids on
assistant/completion tokens (and the appended EOS) and ``-100`` elsewhere, or the ids
everywhere with ``train_on_prompt``. The first token of every sequence always has label
``-100``: with labels shifted inside the loss, that keeps a packed row from predicting the
first token of a sequence from the end of the previous one.

``encode_batch`` is the function ``datasets.Dataset.map(batched=True)`` runs; every row comes
out with a ``status`` (see ``STATUSES``) so bad rows are counted, never silently kept.

**Teacher top-k** (logit distillation): when the rows carry a generation's ``top_logprobs`` (and
``completion_token_ids``), each example also gets ``teacher_topk_ids`` / ``teacher_topk_logprobs``,
one list per input token, placed on the tokens of its last assistant turn that are the tokens
the teacher generated (``campaign_orchestrator.dataset.topk.locate_teacher_topk``; plain template: the completion and
EOS; chat template: the completion inside the turn, plus the turn's EOS when it is the teacher's
stop token), and cut with the row when it is truncated. The pair fast path is skipped for them.
A teacher with another tokenizer (``teacher`` a :class:`campaign_orchestrator.dataset.xtok.CrossTokenizer`) is
placed by byte offsets instead, with the columns ``teacher_align`` / ``teacher_span_logprob`` beside them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from campaign_orchestrator.dataset.topk import (
    SOURCE_TOKEN_IDS,
    SOURCE_TOP_LOGPROBS,
    TEACHER_IDS,
    TEACHER_LOGPROBS,
    locate_teacher_topk,
)
from campaign_orchestrator.dataset.xtok import (
    SOURCE_TEACHER,
    SOURCE_TOKEN_STRINGS,
    TEACHER_ALIGN,
    TEACHER_SPAN,
    CrossTokenizer,
)

IGNORE = -100

OK, TRUNCATED = "ok", "truncated"
# Row outcomes; every one except ok/truncated is a counted drop.
STATUSES = (
    OK,
    TRUNCATED,
    "too_long",  # longer than max_seq_len with too_long=drop
    "no_loss_tokens",  # nothing to learn from (e.g. truncation cut the whole completion)
    "missing_field",  # prompt/completion/messages absent or null
    "not_a_string",  # a prompt, completion or message content that is not a string
    "invalid_messages",  # messages not a list of {role, content}, no assistant turn, bad role
    "template_error",  # the chat template failed or rendered prefixes inconsistently
)
DROP_STATUSES = tuple(s for s in STATUSES if s not in (OK, TRUNCATED))
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class FormatError(ValueError):
    """A template or tokenizer that cannot be used (not a per-row problem)."""


@dataclass(frozen=True)
class Template:
    """How examples are rendered; recorded in the dataset's metadata."""

    kind: str  # "chat" | "plain"
    bos_id: int | None  # plain: prepended (the tokenizer adds it to a bare prompt)
    eos_id: int
    chat_template: str | None = None

    def describe(self) -> str:
        if self.kind == "chat":
            return "chat: tokenizer chat template; loss on assistant turns; EOS appended unless the turn has it"
        return f"plain: {'<bos> ' if self.bos_id is not None else ''}prompt completion <eos>"


def resolve_template(tok, mode: str = "auto") -> Template:
    """Pick the template for ``tok``: ``auto`` uses its chat template when it has one."""
    if tok.eos_token_id is None:
        raise FormatError("the student tokenizer has no eos_token; set one so generation knows where to stop")
    has_chat = bool(getattr(tok, "chat_template", None))
    if mode == "chat" and not has_chat:
        raise FormatError(
            "dataset.template is 'chat' but the student tokenizer has no chat_template; use 'auto' or 'plain'"
        )
    if mode not in ("auto", "chat", "plain"):
        raise FormatError(f"dataset.template must be auto, chat or plain, got {mode!r}")
    if has_chat and mode != "plain":
        return Template("chat", None, tok.eos_token_id, tok.chat_template)
    probe = tok("a")["input_ids"]
    bos = tok.bos_token_id if tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id] else None
    return Template("plain", bos, tok.eos_token_id)


# --------------------------------------------------------------------------- rendering


def _check_messages(messages: Any) -> str | None:
    """None when ``messages`` is a usable conversation, else the drop status."""
    if not isinstance(messages, list) or not messages:
        return "invalid_messages"
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or m.get("role") not in ROLES:
            return "invalid_messages"
        if m.get("content") is None:
            return "missing_field"
        if not isinstance(m["content"], str):
            return "not_a_string"
    if not any(m["role"] == "assistant" for m in messages):
        return "invalid_messages"
    return None


def _render(tok, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def chat_segments(tok, messages: list[dict]) -> list[tuple[str, bool]]:
    """Text pieces of a conversation, each flagged True when it is an assistant turn."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _render(tok, messages[:i], True) if i else ""
        full = _render(tok, messages[: i + 1], False)
        if not prefix.startswith(done) or not full.startswith(prefix):
            raise FormatError(
                "the chat template does not render conversation prefixes consistently "
                "(it rewrites earlier turns), so assistant tokens cannot be located"
            )
        pieces += [(prefix[len(done) :], False), (full[len(prefix) :], True)]
        done = full
    if messages[-1]["role"] != "assistant":
        full = _render(tok, messages, False)
        if not full.startswith(done):
            raise FormatError("the chat template does not render conversation prefixes consistently")
        pieces.append((full[len(done) :], False))
    return [(t, loss) for t, loss in pieces if t or loss]


def check_prefix_space(tok, template: Template) -> None:
    """``data.targets.prefix_space``: an assistant turn written after one space keeps it through ``template``; a chat
    template that trims the turn's content (``| trim``) would make the setting change nothing, so it is an error."""
    if template.kind == "plain":
        return
    pieces = chat_segments(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": " x"}])
    if not any(loss and t.startswith(" x") for t, loss in pieces):
        raise FormatError(
            "data.targets.prefix_space: true, but the student's chat template strips the space before an assistant "
            "turn (it renders ' x' as 'x'), so every target would be tokenized without it: set prefix_space: false, "
            "or dataset.template: plain"
        )


def plain_segments(messages: list[dict]) -> list[tuple[str, bool]] | None:
    """A single exchange as plain text pieces; None for conversations plain mode cannot express."""
    roles = [m["role"] for m in messages]
    if roles not in (["user", "assistant"], ["system", "user", "assistant"]):
        return None
    prompt = "\n".join(m["content"] for m in messages[:-1])
    return [(prompt, False), (messages[-1]["content"], True)]


# --------------------------------------------------------------------------- tokenizing


@dataclass(frozen=True)
class EncodeSettings:
    max_seq_len: int
    too_long: str = "drop"  # "drop" | "truncate" (keep the first max_seq_len tokens)
    train_on_prompt: bool = False


def concat_pieces(
    piece_ids: Sequence[Sequence[int]], flags: Sequence[bool], template: Template, train_on_prompt: bool = False
) -> tuple[list[int], list[int], tuple[int, int]]:
    """Concatenate tokenized pieces into the full (untruncated) ``(input_ids, labels)`` of an example,
    plus the ``[start, end)`` token span of its last loss piece (the answer, with the EOS appended to
    it). List concatenation only (no per-token Python loop): this runs once per example."""
    ids: list[int] = [template.bos_id] if template.bos_id is not None else []
    labels: list[int] = [IGNORE] * len(ids)
    last_loss = max((i for i, f in enumerate(flags) if f), default=None)
    answer = (0, 0)
    for i, (p, flag) in enumerate(zip(piece_ids, flags, strict=True)):
        p = list(p)
        start = len(ids)
        ids += p
        if flag and not train_on_prompt and template.kind == "chat" and template.eos_id in p:
            # The turn's text ends with the end-of-turn token and then the template's separator (ChatML's
            # "\n" after <|im_end|>): the model must learn to stop, not to write the separator.
            end = len(p) - p[::-1].index(template.eos_id)
            labels += p[:end] + [IGNORE] * (len(p) - end)
        else:
            labels += p if (flag or train_on_prompt) else [IGNORE] * len(p)
        if i == last_loss:
            if template.eos_id not in p:
                ids.append(template.eos_id)
                labels.append(template.eos_id)
            answer = (start, len(ids))
    if labels:
        labels[0] = IGNORE
    return ids, labels, answer


def finish_row(ids: list[int], labels: list[int], settings: EncodeSettings) -> tuple[list[int], list[int], int, str]:
    """Apply ``max_seq_len`` (drop or truncate) and count loss tokens: (input_ids, labels, loss tokens, status)."""
    status = OK
    if len(ids) > settings.max_seq_len:
        if settings.too_long == "drop":
            return [], [], 0, "too_long"
        ids, labels, status = ids[: settings.max_seq_len], labels[: settings.max_seq_len], TRUNCATED
    n_loss = len(labels) - labels.count(IGNORE)
    if n_loss == 0:
        return [], [], 0, "no_loss_tokens"
    return ids, labels, n_loss, status


def assemble(
    piece_ids: Sequence[Sequence[int]], flags: Sequence[bool], template: Template, settings: EncodeSettings
) -> tuple[list[int], list[int], int, str]:
    """Concatenate tokenized pieces into (input_ids, labels, loss token count, status)."""
    ids, labels, _answer = concat_pieces(piece_ids, flags, template, settings.train_on_prompt)
    return finish_row(ids, labels, settings)


def _example_pieces(row: dict, template: Template, tok) -> tuple[list[tuple[str, bool]] | None, str | None]:
    """(pieces, None) for a usable row, else (None, drop status)."""
    if "messages" in row:
        msgs = row["messages"]
        bad = _check_messages(msgs)
        if bad:
            return None, bad
        msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
    else:
        p, c = row.get("prompt"), row.get("completion")
        if p is None or c is None:
            return None, "missing_field"
        if not isinstance(p, str) or not isinstance(c, str):
            return None, "not_a_string"
        if template.kind == "plain":
            return [(p, False), (c, True)], None
        msgs = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
    if template.kind == "plain":
        pieces = plain_segments(msgs)
        return (pieces, None) if pieces is not None else (None, "invalid_messages")
    try:
        return chat_segments(tok, msgs), None
    except Exception:  # noqa: BLE001 - a template that fails on one row is a counted drop
        return None, "template_error"


def tokenize_texts(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of many texts in one call, without special tokens. Goes straight to the Rust
    tokenizer of a fast tokenizer (the transformers wrapper builds a dict per text, which costs
    more than the tokenization of short texts)."""
    if not texts:
        return []
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        # a tokenizer.json may be saved with padding/truncation switched on (the wrapper resets them on
        # every call of its own, so switching them off here changes nothing for its later calls)
        if backend.padding is not None:
            backend.no_padding()
        if backend.truncation is not None:
            backend.no_truncation()
        fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in fast(texts, add_special_tokens=False)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def encode_batch(
    batch: dict[str, list],
    tok,
    template: Template,
    settings: EncodeSettings,
    teacher: bool | CrossTokenizer | None = None,
) -> dict[str, list]:
    """``Dataset.map(batched=True)`` body: one fast-tokenizer call for every text piece of the batch.

    Input columns: ``id`` and either ``prompt``/``completion`` or ``messages``; optionally the
    teacher's ``top_logprobs`` (and ``completion_token_ids``). Output columns: ``id``,
    ``input_ids``, ``labels``, ``num_tokens``, ``num_loss_tokens``, ``status``; with
    ``top_logprobs`` in the batch also ``teacher_topk_ids``, ``teacher_topk_logprobs`` (one list
    per input token, cut with the row when it is truncated) and ``teacher_status``
    (``campaign_orchestrator.dataset.topk``). ``teacher=True`` writes those columns (empty lists) for a batch without
    ``top_logprobs`` too, so every source of a build has the same columns. ``teacher`` a ``CrossTokenizer``: the
    teacher has another tokenizer; its top-k is placed by byte offsets (``campaign_orchestrator.dataset.xtok``),
    with ``teacher_align`` and ``teacher_span_logprob`` also written.
    """
    n = len(batch["id"])
    if teacher is None:
        teacher = SOURCE_TOP_LOGPROBS in batch
    xtok = teacher if isinstance(teacher, CrossTokenizer) else None
    no_lists = [None] * n
    tops, gens = batch.get(SOURCE_TOP_LOGPROBS, no_lists), batch.get(SOURCE_TOKEN_IDS, no_lists)
    strings, answered_by = batch.get(SOURCE_TOKEN_STRINGS, no_lists), batch.get(SOURCE_TEACHER, no_lists)
    cols = [c for c in ("prompt", "completion", "messages") if c in batch]
    rows = [{c: batch[c][i] for c in cols} for i in range(n)]
    per_row: list[tuple[list[tuple[str, bool]] | None, str | None]] = [_example_pieces(r, template, tok) for r in rows]
    texts = [t for pieces, _ in per_row if pieces for t, _flag in pieces]
    encoded = tokenize_texts(tok, texts)
    out: dict[str, list] = {
        "id": [],
        "input_ids": [],
        "labels": [],
        "num_tokens": [],
        "num_loss_tokens": [],
        "status": [],
    }
    if teacher:
        out |= {TEACHER_IDS: [], TEACHER_LOGPROBS: [], "teacher_status": []}
    if xtok is not None:
        out |= {TEACHER_ALIGN: [], TEACHER_SPAN: []}
    k = 0
    for i, (pieces, bad) in enumerate(per_row):
        t_ids = t_lps = placed = None
        t_status = "none"
        if pieces is None:
            ids, labels, n_loss, status = [], [], 0, bad
        else:
            chunk = encoded[k : k + len(pieces)]
            k += len(pieces)
            full_ids, full_labels, answer = concat_pieces(
                chunk, [f for _t, f in pieces], template, settings.train_on_prompt
            )
            ids, labels, n_loss, status = finish_row(full_ids, full_labels, settings)
            if xtok is not None and ids:
                source = {
                    SOURCE_TOP_LOGPROBS: tops[i],
                    SOURCE_TOKEN_IDS: gens[i],
                    SOURCE_TOKEN_STRINGS: strings[i],
                    SOURCE_TEACHER: answered_by[i],
                }
                placed, t_status = xtok.locate(
                    full_ids, full_labels, answer, _answer_text(rows[i]), source, template.eos_id
                )
                if placed is not None:
                    placed = placed.cut(len(ids))  # truncation cuts the lists with the row
                    t_ids, t_lps = placed.ids, placed.logprobs
            elif teacher and ids:
                t_ids, t_lps, t_status = locate_teacher_topk(
                    full_ids, full_labels, answer, tops[i], gens[i], str(batch["id"][i])
                )
        out["id"].append(batch["id"][i])
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["num_tokens"].append(len(ids))
        out["num_loss_tokens"].append(n_loss)
        out["status"].append(status)
        if teacher:
            if t_ids is None:
                t_ids = t_lps = [[] for _ in ids]
            out[TEACHER_IDS].append(t_ids[: len(ids)])  # truncation cuts the lists with the row
            out[TEACHER_LOGPROBS].append(t_lps[: len(ids)])
            out["teacher_status"].append(t_status)
        if xtok is not None:
            out[TEACHER_ALIGN].append(placed.align if placed is not None else [0] * len(ids))
            out[TEACHER_SPAN].append(placed.span if placed is not None else [0.0] * len(ids))
    return out


def _answer_text(row: dict) -> str | None:
    """The text of an example's last assistant turn (what the teacher generated)."""
    if "messages" in row:
        turns = [m for m in row["messages"] or [] if isinstance(m, dict) and m.get("role") == "assistant"]
        return turns[-1].get("content") if turns else None
    return row.get("completion")


def render_prompt_ids(tok, prompt: str | Sequence[dict], mode: str = "auto") -> list[int]:
    """The one rendering of a prompt for generation (teacher, evaluation, drift): a string is one user
    turn (:func:`prompt_token_ids`); a list of ``{role, content}`` messages is rendered whole with the
    chat template's generation prompt (context distillation: system prompt and few-shot turns first)."""
    if isinstance(prompt, str):
        return prompt_token_ids(tok, prompt, mode)
    if resolve_template(tok, mode).kind != "chat":
        raise FormatError("chat messages (e.g. teacher.context) need a tokenizer with a chat template")
    return tokenize_texts(tok, [_render(tok, [dict(m) for m in prompt], True)])[0]


def prompt_token_ids(tok, prompt: str, mode: str = "auto") -> list[int]:
    """The token ids a generator should feed for ``prompt`` so inference sees exactly what training
    saw before the completion: the chat template's generation prompt when the tokenizer has one
    (``mode`` as in ``dataset.template``), else ``[bos] + prompt``."""
    template = resolve_template(tok, mode)
    if template.kind == "chat":
        text = _render(tok, [{"role": "user", "content": prompt}], True)
        return tokenize_texts(tok, [text])[0]
    bos = [template.bos_id] if template.bos_id is not None else []
    return bos + tokenize_texts(tok, [prompt])[0]


def _list_array(lists: list[list[int]]):
    """list<int32> Arrow array from Python lists via one flat numpy buffer (pyarrow's per-element
    conversion of nested lists costs more than the tokenization)."""
    import numpy as np
    import pyarrow as pa

    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    offsets = np.zeros(len(lists) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int32, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def _pair_inputs(batch):
    """(rows, id array, status array, indices of usable rows, their prompt texts then their completion
    texts) of a prompt/completion batch: a dict of lists, or an Arrow table (``Dataset.map`` on an
    Arrow-formatted dataset), whose string columns are checked for nulls without a per-row loop."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(batch, pa.Table):
        p, c = batch.column("prompt"), batch.column("completion")
        n = batch.num_rows
        if all(pa.types.is_string(x.type) or pa.types.is_large_string(x.type) for x in (p, c)):
            valid = pc.and_(pc.is_valid(p), pc.is_valid(c))
            status = np.where(valid.to_numpy(zero_copy_only=False), OK, "missing_field").astype(object)
            texts = p.filter(valid).to_pylist() + c.filter(valid).to_pylist()
            ok = np.flatnonzero(status == OK)
            return n, batch.column("id").combine_chunks().cast(pa.string()), status, ok, texts
        batch = {"id": batch.column("id").to_pylist(), "prompt": p.to_pylist(), "completion": c.to_pylist()}
    prompts, completions = batch["prompt"], batch["completion"]
    n = len(prompts)
    status = np.full(n, OK, dtype=object)
    ok: list[int] = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if p is None or c is None:
            status[i] = "missing_field"
        elif not isinstance(p, str) or not isinstance(c, str):
            status[i] = "not_a_string"
        else:
            ok.append(i)
    texts = [prompts[i] for i in ok] + [completions[i] for i in ok]
    return n, pa.array(batch["id"], pa.string()), status, np.asarray(ok, dtype=np.int64), texts


def _plain_pairs_arrow(batch: dict[str, list], tok, template: Template, settings: EncodeSettings):
    """``encode_batch`` for prompt/completion pairs with the plain template, assembled with numpy
    index arithmetic instead of per-row Python lists (same result; a test holds them equal)."""
    import numpy as np
    import pyarrow as pa

    n, ids_col, status, ok, texts = _pair_inputs(batch)
    m = len(ok)
    enc = tokenize_texts(tok, texts)
    lens = np.fromiter(map(len, enc), dtype=np.int64, count=2 * m)
    off = np.zeros(2 * m + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    flat = np.fromiter(itertools.chain.from_iterable(enc), dtype=np.int64, count=int(off[-1]))
    lp, lc, split = lens[:m], lens[m:], int(off[m])
    eos, nb = template.eos_id, int(template.bos_id is not None)
    eos_seen = np.concatenate(([0], np.cumsum(flat == eos)))
    add_eos = (eos_seen[off[m + 1 :]] - eos_seen[off[m : 2 * m]]) == 0  # completion without EOS
    row_len = nb + lp + lc + add_eos
    row_off = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(row_len, out=row_off[1:])
    starts, total = row_off[:-1], int(row_off[-1])
    ids = np.empty(total, dtype=np.int64)
    labels = np.full(total, IGNORE, dtype=np.int64)
    if nb:
        ids[starts] = template.bos_id
    p_dst = np.repeat(starts + nb - off[:m], lp) + np.arange(split)
    c_dst = np.repeat(starts + nb + lp - off[m : 2 * m], lc) + np.arange(split, int(off[-1]))
    ids[p_dst] = flat[:split]
    ids[c_dst] = labels[c_dst] = flat[split:]
    eos_pos = row_off[1:][add_eos] - 1
    ids[eos_pos] = labels[eos_pos] = eos
    if settings.train_on_prompt:
        labels = ids.copy()
    labels[starts] = IGNORE
    too_long = row_len > settings.max_seq_len
    keep_row = ~too_long if settings.too_long == "drop" else np.ones(m, dtype=bool)
    new_len = np.where(keep_row, np.minimum(row_len, settings.max_seq_len), 0)
    keep = (np.arange(total) - np.repeat(starts, row_len)) < np.repeat(new_len, row_len)
    loss_seen = np.concatenate(([0], np.cumsum((labels != IGNORE) & keep)))
    n_loss = loss_seen[row_off[1:]] - loss_seen[starts]
    no_loss = keep_row & (n_loss == 0)
    keep &= np.repeat(~no_loss, row_len)
    new_len[no_loss] = 0
    status[ok[~keep_row]] = "too_long"
    status[ok[no_loss]] = "no_loss_tokens"
    status[ok[keep_row & ~no_loss & too_long]] = TRUNCATED
    full_len = np.zeros(n, dtype=np.int64)
    loss = np.zeros(n, dtype=np.int64)
    if m:
        full_len[ok] = new_len
        loss[ok] = np.where(new_len > 0, n_loss, 0)
    offsets = pa.array(np.concatenate(([0], np.cumsum(full_len))).astype(np.int32))
    return pa.table(
        {
            "id": ids_col,
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids[keep].astype(np.int32))),
            "labels": pa.ListArray.from_arrays(offsets, pa.array(labels[keep].astype(np.int32))),
            "num_tokens": pa.array(full_len.astype(np.int32)),
            "num_loss_tokens": pa.array(loss.astype(np.int32)),
            "status": pa.array(status, pa.string()),
        }
    )


def encode_batch_arrow(
    batch, tok, template: Template, settings: EncodeSettings, teacher: bool | CrossTokenizer | None = None
):
    """``encode_batch`` returning a ``pyarrow.Table`` (what ``Dataset.map`` writes without converting);
    ``batch`` is a dict of lists or an Arrow table (an Arrow-formatted dataset's batch)."""
    import pyarrow as pa

    names = batch.column_names if isinstance(batch, pa.Table) else batch
    if teacher is None:
        teacher = SOURCE_TOP_LOGPROBS in names
    if template.kind == "plain" and "messages" not in names and not teacher:
        return _plain_pairs_arrow(batch, tok, template, settings)
    if isinstance(batch, pa.Table):
        batch = batch.to_pydict()
    out = encode_batch(batch, tok, template, settings, teacher)
    cols = {
        "id": pa.array(out["id"], pa.string()),
        "input_ids": _list_array(out["input_ids"]),
        "labels": _list_array(out["labels"]),
        "num_tokens": pa.array(out["num_tokens"], pa.int32()),
        "num_loss_tokens": pa.array(out["num_loss_tokens"], pa.int32()),
        "status": pa.array(out["status"], pa.string()),
    }
    if teacher:
        cols[TEACHER_IDS] = pa.array(out[TEACHER_IDS], pa.list_(pa.list_(pa.int32())))
        cols[TEACHER_LOGPROBS] = pa.array(out[TEACHER_LOGPROBS], pa.list_(pa.list_(pa.float32())))
        cols["teacher_status"] = pa.array(out["teacher_status"], pa.string())
    if TEACHER_ALIGN in out:
        cols[TEACHER_ALIGN] = pa.array(out[TEACHER_ALIGN], pa.list_(pa.int8()))
        cols[TEACHER_SPAN] = pa.array(out[TEACHER_SPAN], pa.list_(pa.float32()))
    return pa.table(cols)
