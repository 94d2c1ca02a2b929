"""Cross-tokenizer logit distillation: the teacher's top-k placed on the student's tokens by byte offsets.

Torch-free data preparation (the loss is ``training.losses.xtok_sums``). A teacher whose tokenizer is not the
student's generates tokens that do not line up with the student's, and its top-k candidates are ids of another
vocabulary, or (an API teacher) only strings. Both sides are therefore read as **bytes**:

* the teacher's positions: each generated token's bytes and its byte span in the completion's UTF-8 text, with
  its top-k candidates as byte strings. A local or vLLM teacher's ids become bytes through its own tokenizer
  (:class:`TokenizerBytes`); an API teacher's rows carry the generated tokens as text
  (``completion_token_strings``, :mod:`campaign_orchestrator.generation.rows`) and its candidates as text, a
  token that is not whole UTF-8 written ``bytes:\\xNN...`` (:func:`token_string` / :func:`string_bytes`);
* the student's positions: the tokens of the row's answer span, each id's bytes through the student's tokenizer,
  spanning the same text.

:func:`align_spans` walks the two lists of spans and closes a *group* wherever both sides reach the same byte
boundary (the points where the two tokenizers agree on a split; TRL's GOLD trainer aligns the same way). A group
of one student token and one teacher token covers the same bytes, so both predict the same string from the same
prefix: an **exact** position, where the teacher's candidates that are also student tokens (same bytes) become
student ids and the loss is the top-k + tail KL of the same-vocabulary path (candidates the student's vocabulary
lacks fall in the tail). Every other group is a **vocabulary-free** (ULD, Boizard et al. 2024) group: both sides'
distributions at the group's first position, each scaled by the probability its model gives the rest of the
group's text (the chain rule over the tokens the group holds after the first), are compared as sorted
probability vectors. The teacher's stop position (after the text: its EOS or end of turn) lines up with the
student's stop token and is exact, the teacher's stop candidate standing for the student's stop token.

Columns written per input token (beside ``teacher_topk_ids`` / ``teacher_topk_logprobs`` of
:mod:`campaign_orchestrator.dataset.topk`, which keep their meaning at exact positions: student ids, -1 for a
candidate the student's vocabulary lacks):

    teacher_align          list<int8>     0 no teacher distribution, 1 exact, 2 ULD group head, 3 ULD group
                                          continuation (a later student token of the head's group)
    teacher_span_logprob   list<float32>  at a ULD head: the teacher's log-probability of the rest of the group
                                          (its chosen tokens after the first); 0 elsewhere

At a ULD head, ``teacher_topk_logprobs`` holds the teacher's top-k at the group's first teacher position, most
likely first, and ``teacher_topk_ids`` is -1 for each (the ids mean nothing across vocabularies).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from campaign_orchestrator.dataset.topk import SOURCE_TOKEN_IDS, SOURCE_TOP_LOGPROBS

NONE, EXACT, ULD_HEAD, ULD_CONT = 0, 1, 2, 3
KIND_NAMES = {NONE: "none", EXACT: "exact", ULD_HEAD: "uld", ULD_CONT: "uld"}
TEACHER_ALIGN = "teacher_align"
TEACHER_SPAN = "teacher_span_logprob"
XTOK_COLUMNS = (TEACHER_ALIGN, TEACHER_SPAN)
# Source (distillation set) columns: an API teacher's generated tokens as text, and which teacher answered.
SOURCE_TOKEN_STRINGS = "completion_token_strings"
SOURCE_TEACHER = "teacher"
XTOK_SOURCE_COLUMNS = (SOURCE_TOKEN_STRINGS, SOURCE_TEACHER)
ALIGNMENT_FORMAT = "teacher_alignment/v1"  # the columns above; part of the tokenized dataset's key in this mode

# Per-example outcome (``teacher_status``) beyond campaign_orchestrator.dataset.topk's.
NO_TOKEN_TEXT = "no_token_text"  # an API row without its generated tokens' text (cached before they were kept)
TEACHER_TEXT_MISMATCH = "teacher_text_mismatch"  # the teacher's tokens do not spell the completion
STUDENT_TEXT_MISMATCH = "not_found"  # the row's answer tokens do not spell the completion (a template rewrote it)
XTOK_STATUSES = (NO_TOKEN_TEXT, TEACHER_TEXT_MISMATCH)

_BYTES_PREFIX = "bytes:"
_HEX_ESCAPES = re.compile(r"(?:\\x[0-9a-fA-F]{2})+")


class XtokError(ValueError):
    """A tokenizer whose tokens cannot be read as bytes, or an alignment input that is malformed."""


# --------------------------------------------------------------------------- token text <-> bytes


def token_string(b: bytes) -> str:
    """A token's bytes as the text stored in a generation row: the text itself when the bytes are whole UTF-8,
    else ``bytes:`` and one ``\\xNN`` per byte (a byte-level token may hold part of a character)."""
    try:
        s = b.decode("utf-8")
    except UnicodeDecodeError:
        return _BYTES_PREFIX + "".join(f"\\x{x:02x}" for x in b)
    return s if not s.startswith(_BYTES_PREFIX) else _BYTES_PREFIX + "".join(f"\\x{x:02x}" for x in b)


def string_bytes(s: str) -> bytes:
    """The bytes of a stored token text (the inverse of :func:`token_string`; OpenAI's partial-character
    tokens ``bytes:\\xe2\\x80`` read the same way)."""
    if s.startswith(_BYTES_PREFIX) and _HEX_ESCAPES.fullmatch(s[len(_BYTES_PREFIX) :]):
        return bytes(int(h, 16) for h in s[len(_BYTES_PREFIX) :].split("\\x")[1:])
    return s.encode("utf-8")


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character table (byte-level BPE vocabularies spell bytes this way:
    printable bytes as themselves, the others shifted past 255), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable, strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _components(node: dict | None) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [c for sub in node.get("decoders") or node.get("pretokenizers") or [] for c in _components(sub)]
    return [node]


def _scheme(spec: dict) -> str:
    """How a tokenizer.json spells bytes in its vocabulary: ``byte_level`` (GPT-2's table), ``metaspace``
    (SentencePiece's ▁ for a space, ``<0xNN>`` byte fallback) or ``text`` (the token is its text)."""
    parts = _components(spec.get("decoder")) + _components(spec.get("pre_tokenizer"))
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return "byte_level"
    if (
        "Metaspace" in types
        or "ByteFallback" in types
        or any(p.get("type") == "Replace" and "▁" in json.dumps(p.get("pattern")) for p in parts)
    ):
        return "metaspace"
    return "text"


@dataclass
class TokenizerBytes:
    """A tokenizer's tokens as bytes: ``id_bytes[i]`` (None for special tokens, which stand for no text) and the
    reverse map of non-special tokens (the lowest id where two spell the same bytes); special tokens by name
    (``<|im_end|>``: a teacher's special candidate becomes the student's special token of the same name)."""

    identity: str
    id_bytes: list[bytes | None]
    special: frozenset[int]
    stop_ids: frozenset[int]
    special_names: dict[int, str] = field(default_factory=dict)
    to_id: dict[bytes, int] = field(default_factory=dict)
    special_ids: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.to_id:
            for i, b in enumerate(self.id_bytes):
                if b is not None and b not in self.to_id:
                    self.to_id[b] = i
        if not self.special_ids:
            self.special_ids = {name: i for i, name in sorted(self.special_names.items(), reverse=True)}

    @classmethod
    def from_tokenizer(cls, tok, identity: str = "") -> TokenizerBytes:
        """From a transformers fast tokenizer (its ``backend_tokenizer``'s vocabulary and decoder)."""
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            raise XtokError(
                f"the tokenizer {getattr(tok, 'name_or_path', tok)!r} is not a fast tokenizer: cross-tokenizer "
                "distillation reads its tokens as bytes from its tokenizer.json"
            )
        spec = json.loads(backend.to_str())
        scheme = _scheme(spec)
        vocab = backend.get_vocab(with_added_tokens=True)
        size = max(vocab.values()) + 1 if vocab else 0
        special = {int(i) for i in getattr(tok, "all_special_ids", [])}
        special |= {int(t["id"]) for t in spec.get("added_tokens") or [] if t.get("special")}
        added = {int(t["id"]) for t in spec.get("added_tokens") or []}
        decoder = _gpt2_byte_decoder() if scheme == "byte_level" else None
        id_bytes: list[bytes | None] = [None] * size
        names: dict[int, str] = {}
        for piece, i in vocab.items():
            if i in special:
                names[i] = piece
                continue
            if i in added:  # an added (non-special) token is its own text
                id_bytes[i] = piece.encode("utf-8")
            elif decoder is not None:
                try:
                    id_bytes[i] = bytes(decoder[c] for c in piece)
                except KeyError:
                    id_bytes[i] = piece.encode("utf-8")
            elif scheme == "metaspace":
                m = _BYTE_FALLBACK.fullmatch(piece)
                id_bytes[i] = bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode("utf-8")
            else:
                id_bytes[i] = piece.encode("utf-8")
        stop = {int(i) for i in [getattr(tok, "eos_token_id", None)] if i is not None}
        return cls(
            identity or str(getattr(tok, "name_or_path", "")), id_bytes, frozenset(special), frozenset(stop), names
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TokenizerBytes:
        from transformers import AutoTokenizer

        from campaign_orchestrator.dataset.tokenizer_files import tokenizer_hash

        return cls.from_tokenizer(AutoTokenizer.from_pretrained(str(model_dir)), tokenizer_hash(model_dir))

    def bytes_of(self, token_id: int) -> bytes | None:
        return self.id_bytes[token_id] if 0 <= token_id < len(self.id_bytes) else None


# --------------------------------------------------------------------------- the teacher's positions


@dataclass
class TeacherPosition:
    """One generated token of the teacher: its byte span ``[start, end)`` in the completion (zero-width at the end
    for the stop position), the chosen token's log-probability (None when it is not among the top-k) and the
    candidates as ``(bytes or None, logprob, is_stop, name)``, most likely first (``name``: a special token's, or
    an API token's text: what a candidate without a student token of its bytes is looked up by)."""

    start: int
    end: int
    stop: bool
    chosen_logprob: float | None
    candidates: list[tuple[bytes | None, float, bool, str | None]]


def teacher_positions(
    completion: str,
    top_logprobs: Sequence[Sequence[dict]],
    token_ids: Sequence[int] | None = None,
    token_strings: Sequence[str] | None = None,
    teacher: TokenizerBytes | None = None,
) -> list[TeacherPosition] | str:
    """The teacher's positions of one generation, or the ``teacher_status`` saying why there are none.

    With ``token_ids`` (a local or vLLM teacher) the ids become bytes through ``teacher`` (its tokenizer); with
    ``token_strings`` (an API teacher) the generated tokens are their text. The tokens must spell the completion;
    the first token after it is the stop position (an EOS, an end of turn, a stop sequence's first token).
    A candidate is a stop candidate when it is the teacher's stop token: its EOS (by id), or the token the row
    stopped with (by id or text)."""
    text = completion.encode("utf-8")
    by_id = all(e.get("token_id") is not None for p in top_logprobs for e in p)
    if token_ids is not None and teacher is not None and by_id:
        keys: list = [int(i) for i in token_ids]
        chosen = [teacher.bytes_of(i) for i in keys]
        stop_keys = set(teacher.stop_ids)
        cand_key, cand_bytes = (lambda e: int(e["token_id"])), (lambda e: teacher.bytes_of(int(e["token_id"])))
        cand_name = lambda e: teacher.special_names.get(int(e["token_id"]))  # noqa: E731
    elif token_strings is not None:
        keys = list(token_strings)
        chosen = [string_bytes(s) for s in keys]
        stop_keys = set()
        cand_key = lambda e: e.get("token")  # noqa: E731
        cand_bytes = lambda e: string_bytes(e["token"]) if e.get("token") is not None else None  # noqa: E731
        cand_name = cand_key
    else:
        return NO_TOKEN_TEXT
    if len(chosen) != len(top_logprobs):
        return "count_mismatch"
    joined = b"".join(b or b"" for b in chosen)
    if not joined.startswith(text) and joined.startswith(b" " + text) and chosen and len(chosen[0] or b"") > 1:
        chosen[0] = chosen[0][1:]  # SentencePiece's dummy prefix: a space the decoded text does not have
    at, n_text = 0, 0
    for b in chosen:  # how many tokens spell the text
        if at >= len(text):
            break
        if not b or not text.startswith(b, at):
            return TEACHER_TEXT_MISMATCH
        at += len(b)
        n_text += 1
    if at < len(text):
        return TEACHER_TEXT_MISMATCH
    if n_text < len(keys):
        stop_keys.add(keys[n_text])
    out: list[TeacherPosition] = []
    at = 0
    for j in range(min(n_text + 1, len(keys))):
        pos = top_logprobs[j]
        cands = [(cand_bytes(e), float(e["logprob"]), cand_key(e) in stop_keys, cand_name(e)) for e in pos]
        lp = next((float(e["logprob"]) for e in pos if cand_key(e) == keys[j]), None)
        if j < n_text:
            out.append(TeacherPosition(at, at + len(chosen[j]), False, lp, cands))
            at += len(chosen[j])
        else:
            out.append(TeacherPosition(at, at, True, lp, cands))
    return out


# --------------------------------------------------------------------------- the alignment


def align_spans(
    student: Sequence[tuple[int, int]], teacher: Sequence[tuple[int, int]]
) -> list[tuple[list[int], list[int]]]:
    """Groups ``(student indices, teacher indices)`` of two tilings of the same bytes: a group closes where both
    sides' tokens end at the same byte. Each side's spans are contiguous, non-empty and in order."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    si: list[int] = []
    tj: list[int] = []
    while i < len(student) and j < len(teacher):
        se, te = student[i][1], teacher[j][1]
        if se <= te:
            si.append(i)
            i += 1
        if te <= se:
            tj.append(j)
            j += 1
        if se == te:
            groups.append((si, tj))
            si, tj = [], []
    if si or tj or i < len(student) or j < len(teacher):
        raise XtokError(f"the two tokenizations do not cover the same bytes (student {student}, teacher {teacher})")
    return groups


@dataclass
class RowLists:
    """The per-input-token columns of one example (see the module docstring)."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    align: list[int]
    span: list[float]

    @classmethod
    def empty(cls, n: int) -> RowLists:
        return cls([[] for _ in range(n)], [[] for _ in range(n)], [NONE] * n, [0.0] * n)

    def cut(self, n: int) -> RowLists:
        """The first ``n`` positions (a truncated row); a ULD group cut in the middle loses its teacher (its
        student side would miss tokens the teacher's side holds)."""
        out = RowLists(self.ids[:n], self.logprobs[:n], self.align[:n], self.span[:n])
        if n < len(self.align) and self.align[n] == ULD_CONT:
            p = n - 1
            while p >= 0 and out.align[p] == ULD_CONT:
                out.align[p] = NONE
                p -= 1
            if p >= 0 and out.align[p] == ULD_HEAD:
                out.align[p], out.ids[p], out.logprobs[p], out.span[p] = NONE, [], [], 0.0
        return out


def student_spans(
    input_ids: Sequence[int], answer: tuple[int, int], text: bytes, student: TokenizerBytes
) -> tuple[list[tuple[int, int]], int | None] | None:
    """The byte spans of the answer's text tokens (in ``input_ids`` order from ``answer[0]``) and the position of
    the student's stop token after them (None: the span ends with the text), or None when the answer's tokens do
    not spell ``text`` from its first byte."""
    lo, hi = answer
    spans: list[tuple[int, int]] = []
    at = 0
    for p in range(lo, hi):
        if at >= len(text):
            return spans, p
        b = student.bytes_of(input_ids[p])
        if not b or not text.startswith(b, at):
            return None
        spans.append((at, at + len(b)))
        at += len(b)
    return (spans, None) if at == len(text) else None


def place(
    input_ids: Sequence[int],
    labels: Sequence[int],
    answer: tuple[int, int],
    completion: str,
    teacher: list[TeacherPosition],
    student: TokenizerBytes,
    stop_id: int | None = None,
    ignore: int = -100,
) -> RowLists | None:
    """The teacher's positions placed on one full (untruncated) row: exact and ULD groups on the answer's label
    positions (see the module docstring); None when the answer's tokens do not spell the completion. The teacher's
    stop candidates become ``stop_id`` (the student's stop token: its template's EOS or end of turn) and, at the
    stop position, the student's own token there."""
    text = completion.encode("utf-8")
    found = student_spans(input_ids, answer, text, student)
    if found is None:
        return None
    spans, stop_pos = found
    out = RowLists.empty(len(input_ids))
    text_t = [t for t in teacher if not t.stop]
    lo = answer[0]
    for s_idx, t_idx in align_spans(spans, [(t.start, t.end) for t in text_t]) if spans else []:
        positions = [lo + i for i in s_idx]
        if any(labels[p] == ignore for p in positions):
            continue  # a token without a label (train_on_prompt off never leaves one inside the answer)
        tp = [text_t[j] for j in t_idx]
        if len(positions) == 1 and len(tp) == 1:
            _exact(out, positions[0], tp[0], stop_id, student)
            continue
        rest = [t.chosen_logprob for t in tp[1:]]
        if any(x is None for x in rest):
            continue  # the teacher's chosen token is not in its top-k: the group's text probability is unknown
        head = positions[0]
        ordered = sorted((c[1] for c in tp[0].candidates), reverse=True)
        out.ids[head], out.logprobs[head] = [-1] * len(ordered), ordered
        out.align[head], out.span[head] = ULD_HEAD, float(sum(rest))
        for p in positions[1:]:
            out.align[p] = ULD_CONT
    stop_t = next((t for t in teacher if t.stop), None)
    if stop_pos is not None and stop_t is not None and labels[stop_pos] != ignore:
        _exact(out, stop_pos, stop_t, int(input_ids[stop_pos]), student)
    return out


def _exact(out: RowLists, p: int, t: TeacherPosition, stop_id: int | None, student: TokenizerBytes) -> None:
    """Exact KL at ``p``: the teacher's candidates as student ids (its stop candidate as ``stop_id``), -1 where the
    student's vocabulary lacks one; duplicates merged. Nothing when no candidate is a student token."""
    merged: dict[int, float] = {}
    unmapped: list[float] = []
    for b, lp, is_stop, name in t.candidates:
        sid = stop_id if (is_stop and stop_id is not None) else (student.to_id.get(b) if b else None)
        if sid is None and name is not None:
            sid = student.special_ids.get(name)
        if sid is None:
            unmapped.append(lp)
        elif sid in merged:
            merged[sid] = _logaddexp(merged[sid], lp)
        else:
            merged[sid] = lp
    if not merged:
        return
    out.ids[p] = [*merged, *([-1] * len(unmapped))]
    out.logprobs[p] = [*merged.values(), *unmapped]
    out.align[p] = EXACT


def _logaddexp(a: float, b: float) -> float:
    m = max(a, b)
    return m + math.log(math.exp(a - m) + math.exp(b - m))


def alignment_report(align, labels) -> dict:
    """Label positions by the part of the cross-tokenizer loss that covers them (``exact``, ``uld``, ``none``: no
    teacher distribution, cross-entropy only), their shares, and the ULD groups (one loss term each)."""
    import numpy as np
    import pyarrow.compute as pc

    kinds = np.asarray(pc.list_flatten(align).to_numpy(zero_copy_only=False), dtype=np.int8)
    labelled = np.asarray(pc.list_flatten(labels).to_numpy(zero_copy_only=False)) != -100
    counts = {
        "exact": int(((kinds == EXACT) & labelled).sum()),
        "uld": int((((kinds == ULD_HEAD) | (kinds == ULD_CONT)) & labelled).sum()),
        "none": int(((kinds == NONE) & labelled).sum()),
    }
    total = max(1, sum(counts.values()))
    return {
        "by": "bytes",
        "positions": counts,
        "shares": {k: round(v / total, 4) for k, v in counts.items()},
        "uld_groups": int(((kinds == ULD_HEAD) & labelled).sum()),
    }


# --------------------------------------------------------------------------- per row, for formatting.encode_batch


@dataclass
class CrossTokenizer:
    """What :func:`campaign_orchestrator.dataset.formatting.encode_batch` needs to place a teacher of another
    tokenizer on the student's rows: the student's bytes, and each teacher's, by the ``teacher`` value of a row
    (``default`` for rows without one; with several teachers routed by category, each row's own). A teacher without a
    tokenizer here (an API teacher) is None: its rows carry their tokens' text. ``identities``: each teacher's
    tokenizer identity (a tokenizer hash, or ``api:<model>``), recorded in the dataset beside the student's."""

    student: TokenizerBytes
    teachers: dict[str, TokenizerBytes | None]
    identities: dict[str, str]
    default: str

    @classmethod
    def for_teacher(
        cls, student_dir: str | Path, teacher: str, teacher_dir: str | Path | None, api: bool
    ) -> CrossTokenizer | None:
        """The byte alignment of ``teacher`` (a model reference; ``teacher_dir``: its tokenizer's directory, None
        for an endpoint without one) onto the student of ``student_dir``, or None when the teacher's token ids are
        the student's (a local teacher with the same tokenizer and vocabulary size: the id path of
        campaign_orchestrator.dataset.topk). An API teacher is always aligned by bytes (it returns text)."""
        from campaign_orchestrator.dataset.checks import vocabulary_report
        from campaign_orchestrator.dataset.tokenizer_files import tokenizer_hash

        if teacher_dir is not None and not api and vocabulary_report(teacher_dir, student_dir)["passed"]:
            return None
        identity = tokenizer_hash(teacher_dir) if teacher_dir is not None else f"api:{teacher}"
        view = None if api or teacher_dir is None else TokenizerBytes.from_dir(teacher_dir)
        return cls(TokenizerBytes.from_dir(student_dir), {teacher: view}, {teacher: identity}, teacher)

    @classmethod
    def for_teachers(
        cls, student_dir: str | Path, teachers: Sequence[tuple[str, str, str | Path | None, bool]], default: str
    ) -> CrossTokenizer:
        """Several teachers routed by category (rows name theirs in ``teacher``): each ``(name, model reference,
        tokenizer directory or None, api)`` placed by bytes under its own tokenizer identity, even one whose ids
        are the student's (rows of several teachers go through one path; where the tokens match every position is
        exact). ``default``: the teacher of a row that names none."""
        from campaign_orchestrator.dataset.tokenizer_files import tokenizer_hash

        views: dict[str, TokenizerBytes | None] = {}
        identities: dict[str, str] = {}
        for name, model, tdir, api in teachers:
            identities[name] = tokenizer_hash(tdir) if tdir is not None else f"api:{model}"
            views[name] = None if api or tdir is None else TokenizerBytes.from_dir(tdir)
        return cls(TokenizerBytes.from_dir(student_dir), views, identities, default)

    def key(self) -> list:
        """What the alignment depends on, for the tokenized dataset's content key."""
        return [ALIGNMENT_FORMAT, self.student.identity, sorted(self.identities.items()), self.default]

    def teacher_for(self, row_teacher: str | None) -> TokenizerBytes | None:
        return self.teachers.get(row_teacher or self.default, self.teachers.get(self.default))

    def locate(
        self,
        input_ids: Sequence[int],
        labels: Sequence[int],
        answer: tuple[int, int],
        completion: str | None,
        row: dict,
        stop_id: int | None = None,
    ) -> tuple[RowLists | None, str]:
        """One full row's columns and its ``teacher_status`` (``aligned`` or why not); ``stop_id``: the student's
        stop token (the template's EOS or end of turn)."""
        top = row.get(SOURCE_TOP_LOGPROBS)
        if not top or completion is None:
            return None, "none"
        tpos = teacher_positions(
            completion,
            top,
            row.get(SOURCE_TOKEN_IDS),
            row.get(SOURCE_TOKEN_STRINGS),
            self.teacher_for(row.get(SOURCE_TEACHER)),
        )
        if isinstance(tpos, str):
            return None, tpos
        lists = place(input_ids, labels, answer, completion, tpos, self.student, stop_id)
        if lists is None:
            return None, STUDENT_TEXT_MISMATCH
        return lists, "aligned"
