"""Cross-tokenizer alignment by byte offsets (campaign_orchestrator.dataset.xtok) on pairs of real tokenizers:
the demo's character tokenizer and its byte-level BPE teacher's, and SmolLM2-135M-Instruct's (multi-byte
characters split across tokens, whitespace runs merged into one token), through the dataset's encode path."""

from __future__ import annotations

import json
import random

import pytest

from campaign_orchestrator.dataset.formatting import EncodeSettings, encode_batch, resolve_template
from campaign_orchestrator.dataset.topk import TEACHER_IDS, TEACHER_LOGPROBS
from campaign_orchestrator.dataset.xtok import (
    EXACT,
    NO_TOKEN_TEXT,
    NONE,
    TEACHER_ALIGN,
    TEACHER_SPAN,
    TEACHER_TEXT_MISMATCH,
    ULD_CONT,
    ULD_HEAD,
    CrossTokenizer,
    TokenizerBytes,
    align_spans,
    string_bytes,
    token_string,
)
from campaign_orchestrator.demo import cipher

_VIEWS: dict[int, TokenizerBytes] = {}


def view(tok) -> TokenizerBytes:
    """A tokenizer's bytes, built once per tokenizer (SmolLM2's 49,152 tokens take a moment)."""
    if id(tok) not in _VIEWS:
        _VIEWS[id(tok)] = TokenizerBytes.from_tokenizer(tok, getattr(tok, "name_or_path", "") or "demo")
    return _VIEWS[id(tok)]


TEXT = "Größe: 日本語 —  “quoted”\n\n    indented\ttab end."


@pytest.fixture(scope="module")
def char_tok():
    from campaign_orchestrator.demo.build import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def bpe_tok():
    from campaign_orchestrator.demo.build import build_xtok_tokenizer

    return build_xtok_tokenizer()


def generation(tok, text: str, k: int = 3, seed: int = 0, stop: bool = True) -> dict:
    """A teacher generation of ``text`` in ``tok``'s own tokens (its stop token last), with top-k lists of real ids
    of its vocabulary, the generated token first."""
    rng = random.Random(seed)
    ids = tok(text, add_special_tokens=False).input_ids + ([tok.eos_token_id] if stop else [])
    top = []
    for n, tid in enumerate(ids):
        others = [i for i in rng.sample(range(len(tok)), k + 1) if i != tid][: k - 1]
        lps = sorted((-0.05 * (n % 3) - 0.1 * j - rng.random() for j in range(k)), reverse=True)
        top.append([{"token_id": c, "token": None, "logprob": lp} for c, lp in zip([tid, *others], lps, strict=True)])
    return {"completion": text, "completion_token_ids": ids, "top_logprobs": top}


def as_api(tok, gen: dict) -> dict:
    """The same generation as an API returns it: tokens as text (``bytes:`` for part of a character), no ids."""
    v = view(tok)

    def text(i: int) -> str:
        b = v.bytes_of(i)
        return token_string(b) if b is not None else tok.convert_ids_to_tokens(i)

    return gen | {
        "completion_token_ids": None,
        "completion_token_strings": [text(i) for i in gen["completion_token_ids"]],
        "top_logprobs": [
            [{"token_id": None, "token": text(e["token_id"]), "logprob": e["logprob"]} for e in pos]
            for pos in gen["top_logprobs"]
        ],
    }


def encode(student, teacher, rows: list[dict], api: bool = False, max_len: int = 256, template: str = "auto"):
    s = view(student)
    t = None if api else view(teacher)
    xt = CrossTokenizer(s, {"teacher": t}, {"teacher": "teacher-tok"}, "teacher")
    batch = {
        k: [r.get(k) for r in rows]
        for k in ("id", "prompt", "completion", "completion_token_ids", "top_logprobs", "completion_token_strings")
    }
    return encode_batch(batch, student, resolve_template(student, template), EncodeSettings(max_len), xt)


def groups_of(align: list[int]) -> list[list[int]]:
    """Positions of each loss term: an exact position alone, a ULD head with its continuations."""
    out: list[list[int]] = []
    for p, a in enumerate(align):
        if a in (EXACT, ULD_HEAD):
            out.append([p])
        elif a == ULD_CONT:
            assert out and align[out[-1][0]] == ULD_HEAD, f"continuation at {p} without a head"
            out[-1].append(p)
    return out


def check_row(student, out: dict, b: int, text: str):
    """Every term covers a span of the answer: an exact position's candidates are student tokens of the teacher's
    candidates' bytes; a ULD head carries the teacher's sorted top-k and the log-prob of the rest of its group."""
    s = view(student)
    ids, align = out["input_ids"][b], out[TEACHER_ALIGN][b]
    answer = [p for p, y in enumerate(out["labels"][b]) if y != -100]
    assert [p for p, a in enumerate(align) if a != NONE] == answer  # every answer token, nothing else
    for g in groups_of(align):
        lps = out[TEACHER_LOGPROBS][b][g[0]]
        if align[g[0]] == EXACT:  # the generated token is the teacher's too, under the student's id
            assert ids[g[0]] in out[TEACHER_IDS][b][g[0]] and len(g) == 1
        else:
            assert lps == sorted(lps, reverse=True) and set(out[TEACHER_IDS][b][g[0]]) == {-1}
    assert b"".join(s.bytes_of(ids[p]) or b"" for p in answer) == text.encode()  # stop token: no bytes


def test_token_text_round_trips_part_of_a_character():
    for b in ["é".encode(), "é".encode()[:1], "日".encode()[1:], b" \xe6", b"bytes:x", b"plain"]:
        assert string_bytes(token_string(b)) == b
    assert token_string(b"\xc3") == "bytes:\\xc3" and token_string(b"ab") == "ab"


def test_a_tokenizer_without_its_tokenizer_json_is_refused_clearly():
    from types import SimpleNamespace

    from campaign_orchestrator.dataset.xtok import XtokError

    with pytest.raises(XtokError, match=r"'slow-tok' is not a fast tokenizer: cross-tokenizer distillation reads"):
        TokenizerBytes.from_tokenizer(SimpleNamespace(name_or_path="slow-tok"))
    with pytest.raises(XtokError, match="do not cover the same bytes"):
        align_spans([(0, 2)], [(0, 1)])


def test_spans_group_where_both_tokenizations_agree_on_a_boundary():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        cuts_a = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
        cuts_b = sorted(rng.sample(range(1, n), rng.randint(0, n - 1))) if n > 1 else []
        a = list(zip([0, *cuts_a], [*cuts_a, n], strict=True))
        b = list(zip([0, *cuts_b], [*cuts_b, n], strict=True))
        groups = align_spans(a, b)
        shared = sorted(set(cuts_a) & set(cuts_b))
        assert [a[g[0][-1]][1] for g in groups] == [*shared, n]  # a group closes exactly at a shared boundary
        assert [i for g in groups for i in g[0]] == list(range(len(a)))
        assert [j for g in groups for j in g[1]] == list(range(len(b)))


def test_the_demo_pair_char_student_bpe_teacher(char_tok, bpe_tok):
    """The demo student's characters against its BPE teacher's tokens: the merged ' x' and letter pairs are ULD
    groups, single letters and the stop token exact, on every cipher answer; ULD covers well over 20%."""
    items = cipher.items(60, seed=3)
    rows = [
        {"id": it["id"], "prompt": it["prompt"]} | generation(bpe_tok, " " + it["reference"], seed=i)
        for i, it in enumerate(items)
    ]
    out = encode(char_tok, bpe_tok, rows)
    assert out["teacher_status"] == ["aligned"] * len(rows)
    kinds = {EXACT: 0, ULD_HEAD: 0, ULD_CONT: 0}
    for b, r in enumerate(rows):
        check_row(char_tok, out, b, r["completion"])
        for a in out[TEACHER_ALIGN][b]:
            if a != NONE:
                kinds[a] += 1
        first = out["labels"][b].index(next(y for y in out["labels"][b] if y != -100))
        t_first = bpe_tok.convert_ids_to_tokens(r["completion_token_ids"][0])
        assert t_first.startswith("Ġ") and len(t_first) > 1  # " x": the space and the first letter, one token
        assert out[TEACHER_ALIGN][b][first : first + 2] == [ULD_HEAD, ULD_CONT]
        assert out[TEACHER_ALIGN][b][-1] == EXACT  # the stop token
        assert out[TEACHER_IDS][b][-1][0] == char_tok.eos_token_id  # ... the teacher's </s> as the student's
        # a head's span: the teacher's log-prob of the rest of its group (its later tokens, chosen: listed first)
        for g in groups_of(out[TEACHER_ALIGN][b]):
            assert out[TEACHER_SPAN][b][g[0]] <= 0.0
    uld = kinds[ULD_HEAD] + kinds[ULD_CONT]
    assert uld / (uld + kinds[EXACT]) > 0.2 and kinds[EXACT] > 0


@pytest.mark.stage  # SmolLM2's tokenizer: the converted model (a conversion on a fresh clone)
def test_an_api_teachers_text_places_exactly_like_its_ids(char_tok, bpe_tok, smollm2_tok):
    """Token strings (an API teacher) and token ids read through the teacher's tokenizer (local, vLLM) give the
    same columns, multi-byte characters split across teacher tokens included."""
    for student, teacher, text in ((char_tok, bpe_tok, " nvvqsz"), (smollm2_tok, bpe_tok, TEXT)):
        gen = generation(teacher, text, seed=4)
        rows_ids = [{"id": "a", "prompt": "encode x ="} | gen]
        rows_api = [{"id": "a", "prompt": "encode x ="} | as_api(teacher, gen)]
        by_ids, by_text = encode(student, teacher, rows_ids), encode(student, teacher, rows_api, api=True)
        assert by_ids["teacher_status"] == by_text["teacher_status"] == ["aligned"]
        for c in (TEACHER_ALIGN, TEACHER_SPAN, TEACHER_IDS, TEACHER_LOGPROBS):
            assert by_ids[c] == by_text[c], c


@pytest.fixture(scope="module")
def smollm2_tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


@pytest.mark.stage  # SmolLM2's tokenizer: the converted model (a conversion on a fresh clone)
def test_smollm2_student_and_the_bpe_teacher_multibyte_and_whitespace(smollm2_tok, bpe_tok):
    """SmolLM2 (chat template: the answer inside the assistant turn, <|im_end|> its stop) against the BPE teacher,
    which splits every non-ASCII character into single bytes: characters split differently on each side, and
    SmolLM2's merged whitespace runs, are ULD groups; the teacher's </s> lands on <|im_end|>."""
    gen = generation(bpe_tok, TEXT, seed=1)
    out = encode(smollm2_tok, bpe_tok, [{"id": "a", "prompt": "Say it."} | gen])
    assert out["teacher_status"] == ["aligned"]
    check_row(smollm2_tok, out, 0, TEXT)
    ids, align = out["input_ids"][0], out[TEACHER_ALIGN][0]
    student = view(smollm2_tok)
    by_text = {student.bytes_of(ids[g[0]]): align[g[0]] for g in groups_of(align) if len(g) == 1}
    assert by_text[b"\n\n   "] == ULD_HEAD  # one student token, five teacher tokens
    assert by_text["ö".encode()] == ULD_HEAD  # one student token, two single-byte teacher tokens
    assert by_text[b"e"] == EXACT  # the same letter on both sides
    assert by_text[b" \xe6"] == ULD_HEAD  # a space and part of 日 in one student token; two teacher tokens
    assert by_text[b"\x97"] == EXACT  # the rest of 日 split alike on both sides: parts of a character, exact
    stop = len(align) - 1 - align[::-1].index(EXACT)
    assert ids[stop] == smollm2_tok.convert_tokens_to_ids("<|im_end|>") == out[TEACHER_IDS][0][stop][0]


@pytest.mark.stage  # SmolLM2's tokenizer: the converted model (a conversion on a fresh clone)
def test_smollm2_teacher_and_the_char_student(smollm2_tok, char_tok):
    """The other way round: a teacher whose tokens are longer (SmolLM2's words) than the student's characters."""
    text = " itssg qzz"
    gen = generation(smollm2_tok, text, seed=2)
    gen["completion_token_ids"][-1] = smollm2_tok.convert_tokens_to_ids("<|im_end|>")  # SmolLM2's stop token
    out = encode(char_tok, smollm2_tok, [{"id": "a", "prompt": "encode x ="} | gen])
    assert out["teacher_status"] == ["aligned"]
    check_row(char_tok, out, 0, text)
    assert out[TEACHER_IDS][0][-1][0] == char_tok.eos_token_id  # <|im_end|> as the student's </s>


def test_rows_that_cannot_be_aligned_keep_cross_entropy_and_are_counted(char_tok, bpe_tok):
    good = generation(bpe_tok, " abc")
    other = generation(bpe_tok, " abd")  # the teacher's tokens spell another text than the completion
    no_text = as_api(bpe_tok, good) | {"completion_token_strings": None}
    rows = [
        {"id": "x", "prompt": "encode ab =", **other, "completion": " abc"},
        {"id": "y", "prompt": "encode ab =", **no_text},
        {"id": "z", "prompt": "encode ab =", "completion": " abc", "top_logprobs": None},
    ]
    out = encode(char_tok, bpe_tok, rows)
    assert out["teacher_status"] == [TEACHER_TEXT_MISMATCH, NO_TOKEN_TEXT, "none"]
    assert all(a == NONE for r in out[TEACHER_ALIGN] for a in r) and out["status"] == ["ok"] * 3
    # the student's template rewrites the answer (a completion its tokenizer cannot spell: <unk>)
    odd = generation(bpe_tok, " aé")
    assert encode(char_tok, bpe_tok, [{"id": "u", "prompt": "encode a ="} | odd])["teacher_status"] == ["not_found"]


def test_truncation_drops_a_group_it_cuts(char_tok, bpe_tok):
    gen = generation(bpe_tok, " " + cipher.encode("hello"), seed=5)
    full = encode(char_tok, bpe_tok, [{"id": "a", "prompt": "encode hello ="} | gen])
    align = full[TEACHER_ALIGN][0]
    head = next(p for p, a in enumerate(align) if a == ULD_HEAD)
    cut_truncated = [{"id": "a", "prompt": "encode hello ="} | gen]
    xt = CrossTokenizer(view(char_tok), {"t": view(bpe_tok)}, {"t": "t"}, "t")
    batch = {
        k: [r.get(k) for r in cut_truncated]
        for k in ("id", "prompt", "completion", "completion_token_ids", "top_logprobs")
    }
    cut = encode_batch(
        batch, char_tok, resolve_template(char_tok, "auto"), EncodeSettings(head + 1, too_long="truncate"), xt
    )
    assert cut["status"] == ["truncated"] and len(cut[TEACHER_ALIGN][0]) == head + 1
    assert cut[TEACHER_ALIGN][0][head] == NONE and cut[TEACHER_IDS][0][head] == []  # its continuation was cut
    assert cut[TEACHER_ALIGN][0][:head] == align[:head]


# ------------------------------------------------------------------ keys: same-tokenizer campaigns are unchanged


def test_same_tokenizer_keys_are_the_ones_before_cross_tokenizer_distillation():
    """The tokenized dataset's key without a byte alignment is the one main computed before this change
    (039f5fc, pinned): a campaign whose teacher shares the student's tokenizer rebuilds nothing."""
    from campaign_orchestrator.dataset.tokenize import BuildSettings
    from stages.tokenized_dataset import content_key

    s = BuildSettings(max_seq_len=64, template="auto", validation_fraction=0.1)
    assert content_key("d" * 20, "t" * 64, s, None, teacher_topk=True) == "50574bf8097ab2dc4630"
    assert content_key("d" * 20, "t" * 64, s, "e" * 64, teacher_topk=False) == "f851c3af6e3734fc21ea"
    aligned = content_key("d" * 20, "t" * 64, s, None, teacher_topk=True, alignment=["teacher_alignment/v1", "x"])
    assert aligned != "50574bf8097ab2dc4630"


def test_a_teacher_of_the_students_tokenizer_takes_the_id_path(demo_models_root, tmp_path):
    """The demo campaign with logit distillation (teacher and student share the character tokenizer) keeps the
    same-vocabulary path, so its key has no alignment part; the BPE teacher, or an API teacher, is aligned."""
    from campaigns.loader import parse_campaign_text
    from stages.storage import Store
    from stages.tokenized_dataset import cross_tokenizer
    from tests.support import REPO_ROOT

    raw = yaml_load(REPO_ROOT / "campaigns" / "demo.yaml")
    raw["teacher"]["sampling"]["logprobs"] = 4
    raw["training"]["distillation"] = {"loss": "logits"}
    spec = parse_campaign_text(yaml_dump(raw))
    storage = Store(str(demo_models_root))
    student = storage.resolve_model(spec.student.base_model, spec.project_dir)
    assert cross_tokenizer(spec, storage, student) is None
    raw["training"]["distillation"] = {"loss": "sequence"}
    assert cross_tokenizer(parse_campaign_text(yaml_dump(raw)), storage, student) is None
    api = yaml_load(REPO_ROOT / "campaigns" / "demo_xtok.yaml")
    api["teacher"] = {
        "backend": "openai",
        "base_url": "http://127.0.0.1:9/v1",
        "model": "cipher-teacher",
        "price": "api-open-70b",
        "sampling": {"logprobs": 4},
    }
    xt = cross_tokenizer(parse_campaign_text(yaml_dump(api)), storage, student)
    assert xt is not None and xt.identities == {"cipher-teacher": "api:cipher-teacher"}
    assert xt.teachers == {"cipher-teacher": None}  # its rows carry their tokens' text


def yaml_load(path):
    import yaml

    return yaml.safe_load(path.read_text())


def yaml_dump(raw: dict) -> str:
    import yaml

    return yaml.safe_dump(raw, sort_keys=False)


def test_the_dataset_build_writes_the_alignment_and_both_tokenizers(tmp_path, char_tok, bpe_tok):
    """build_tokenized_dataset from a distillation set (Parquet) of the BPE teacher's rows onto the character
    student: the alignment columns packed with the rows, the shares in the report, and each teacher's tokenizer
    identity recorded beside the student's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from campaign_orchestrator.dataset.tokenize import BuildSettings, build_tokenized_dataset, dataset_metadata
    from campaign_orchestrator.dataset.xtok import CrossTokenizer
    from stages.distillation_set import distill_schema

    student_dir, teacher_dir = tmp_path / "student", tmp_path / "teacher"
    char_tok.save_pretrained(student_dir)
    bpe_tok.save_pretrained(teacher_dir)
    items = cipher.items(40, seed=9)
    rows = []
    for i, it in enumerate(items):  # half of the rows as an API returns them (token text): the same placement
        gen = generation(bpe_tok, " " + it["reference"], seed=i)
        gen = as_api(bpe_tok, gen) if i % 2 else gen | {"completion_token_strings": None}
        rows.append({"id": it["id"], "prompt": it["prompt"], "teacher": "@demo/teacher_bpe"} | gen)
    src = tmp_path / "distillation.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=distill_schema()), src)
    xt = CrossTokenizer.for_teacher(student_dir, "@demo/teacher_bpe", teacher_dir, api=False)
    assert xt is not None and CrossTokenizer.for_teacher(student_dir, "x", student_dir, api=False) is None
    report = build_tokenized_dataset(
        student_dir, [src], tmp_path / "ds", BuildSettings(max_seq_len=64, num_proc=1), cross_tokenizer=xt
    )
    a = report["teacher_topk"]["alignment"]
    assert report["teacher_topk"]["examples"]["aligned"] == 40 and a["positions"]["none"] == 0
    assert a["shares"]["uld"] > 0.2 and a["positions"]["exact"] + a["positions"]["uld"] == report["loss_tokens"]
    md = dataset_metadata(tmp_path / "ds" / "train")
    assert json.loads(md["campaign.teacher_tokenizers"]) == {"@demo/teacher_bpe": xt.identities["@demo/teacher_bpe"]}
    assert md["campaign.tokenizer_hash"] == xt.student.identity != xt.identities["@demo/teacher_bpe"]
    assert json.loads(md["campaign.teacher_topk"])["alignment"] == "bytes"
    t = pq.read_table(next((tmp_path / "ds" / "train").glob("*.parquet")))
    for r in t.to_pylist():  # packed: one entry per input token, a ULD continuation always after its group's head
        assert len(r[TEACHER_ALIGN]) == len(r["input_ids"]) == len(r[TEACHER_SPAN]) == len(r[TEACHER_IDS])
        assert all(r[TEACHER_ALIGN][p - 1] in (ULD_HEAD, ULD_CONT) for p, x in enumerate(r[TEACHER_ALIGN]) if x == 3)


@pytest.mark.stage  # SmolLM2's tokenizer
def test_the_teacher_server_writes_each_token_as_its_exact_bytes(smollm2_tok):
    """The project's teacher server (the stand-in for an API) names tokens by their bytes, a token that holds part
    of a character as ``bytes:``, so a client with another tokenizer aligns by them; specials by name."""
    from types import SimpleNamespace

    from campaign_orchestrator.teacher.server import TeacherServer

    server = TeacherServer(SimpleNamespace(tok=smollm2_tok), "t")
    ids = smollm2_tok(TEXT, add_special_tokens=False).input_ids
    texts = [server._token_text(i) for i in ids]
    assert b"".join(string_bytes(t) for t in texts) == TEXT.encode()
    assert any(t.startswith("bytes:") for t in texts) and "\n\n   " in texts
    assert server._token_text(smollm2_tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"


def test_rows_of_several_teachers_are_each_placed_by_their_own_tokenizer(char_tok, bpe_tok):
    """A teacher per category (issue 45): one batch with rows of the character teacher and of the BPE teacher, each
    naming its teacher, placed by that teacher's tokenizer: every row aligned, the character teacher's rows exact at
    every position, the BPE teacher's with ULD groups. Placed by the other's tokenizer, the BPE rows' ids read as
    characters do not spell the completion and are refused."""
    items = cipher.items(20, seed=4)
    rows = [
        {"id": it["id"], "prompt": it["prompt"], "teacher": "char" if i % 2 else "bpe"}
        | generation(char_tok if i % 2 else bpe_tok, " " + it["reference"], seed=i)
        for i, it in enumerate(items)
    ]
    keys = ("id", "prompt", "completion", "completion_token_ids", "top_logprobs", "completion_token_strings", "teacher")
    batch = {k: [r.get(k) for r in rows] for k in keys}
    xt = CrossTokenizer(
        view(char_tok), {"char": view(char_tok), "bpe": view(bpe_tok)}, {"char": "c", "bpe": "b"}, "bpe"
    )
    out = encode_batch(batch, char_tok, resolve_template(char_tok, "auto"), EncodeSettings(256), xt)
    assert out["teacher_status"] == ["aligned"] * len(rows)
    for b, r in enumerate(rows):
        kinds = {a for a in out[TEACHER_ALIGN][b] if a != NONE}
        assert kinds == ({EXACT} if r["teacher"] == "char" else {EXACT, ULD_HEAD, ULD_CONT}), (r["teacher"], kinds)
    wrong = CrossTokenizer(view(char_tok), {"char": view(char_tok)}, {"char": "c"}, "char")  # every row as `char`
    bpe_rows = {k: [v for v, r in zip(batch[k], rows, strict=True) if r["teacher"] == "bpe"] for k in keys}
    bad = encode_batch(bpe_rows, char_tok, resolve_template(char_tok, "auto"), EncodeSettings(256), wrong)
    assert "aligned" not in bad["teacher_status"]
