"""Cross-tokenizer distillation loss (training.losses.xtok_sums): exact KL where the tokens match, a
vocabulary-free ULD term elsewhere. Against the same-vocabulary KL, a hand computation, a permuted vocabulary,
and the LM head at labelled positions only."""

from __future__ import annotations

import math

import pytest
import torch

from campaign_orchestrator.dataset.formatting import EncodeSettings, encode_batch, resolve_template
from campaign_orchestrator.dataset.xtok import EXACT, NONE, ULD_CONT, ULD_HEAD, CrossTokenizer, TokenizerBytes
from training import head, losses
from training.recipes import LABEL_ALIGNED


@pytest.fixture(scope="module")
def char_tok():
    from campaign_orchestrator.demo.build import build_tokenizer

    return build_tokenizer()


def _rows(tok, words: list[str], k: int = 4, seed: int = 0):
    """Prompt/completion rows whose teacher generations are ``tok``'s own tokens of the completion, with top-k
    lists over ``tok``'s vocabulary (the generated token among them, most likely first)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, w in enumerate(words):
        comp = " " + w
        ids = tok(comp, add_special_tokens=False).input_ids + [tok.eos_token_id]
        top = []
        for tid in ids:
            others = torch.randperm(len(tok), generator=g)[: k + 1].tolist()
            cands = [tid, *[o for o in others if o != tid][: k - 1]]
            lps = torch.log_softmax(torch.randn(k + 2, generator=g) * 2, -1)[:k].sort(descending=True).values
            top.append([{"token_id": c, "token": None, "logprob": float(lp)} for c, lp in zip(cands, lps, strict=True)])
        rows.append(
            {
                "id": f"r{i}",
                "prompt": f"encode {w} =",
                "completion": comp,
                "top_logprobs": top,
                "completion_token_ids": ids,
            }
        )
    return rows


def _batch(out: dict, xtok: bool) -> dict[str, torch.Tensor]:
    """The trainer's padded batch of encode_batch's rows (losses.teacher_batch on in-memory columns)."""
    import pyarrow as pa

    width = max(len(x) for x in out["input_ids"])
    n = len(out["input_ids"])
    labels = torch.full((n, width), -100)
    input_ids = torch.zeros((n, width), dtype=torch.long)
    for b, (x, y) in enumerate(zip(out["input_ids"], out["labels"], strict=True)):
        input_ids[b, : len(x)], labels[b, : len(y)] = torch.tensor(x), torch.tensor(y)
    cols = [losses.TEACHER_IDS, losses.TEACHER_LOGPROBS] + ([losses.TEACHER_ALIGN, losses.TEACHER_SPAN] if xtok else [])
    columns = {c: pa.chunked_array([pa.array(out[c])]) for c in cols}
    return {"input_ids": input_ids, "labels": labels} | losses.teacher_batch(columns, list(range(n)), (n, width))


def test_identical_vocabularies_give_exactly_the_same_vocabulary_kl(char_tok):
    """Teacher and student with one tokenizer, aligned by bytes: every position is exact, the student ids are the
    teacher's, and the loss equals the same-vocabulary top-k KL of the id path."""
    words = ["nvv", "itssg", "qzzyxa", "abc", "mmmmmmmm"]
    rows = _rows(char_tok, words)
    tmpl = resolve_template(char_tok, "auto")
    batch = {k: [r[k] for r in rows] for k in rows[0]}
    by_ids = encode_batch(batch, char_tok, tmpl, EncodeSettings(64), True)
    same = TokenizerBytes.from_tokenizer(char_tok, "demo")
    by_bytes = encode_batch(
        batch, char_tok, tmpl, EncodeSettings(64), CrossTokenizer(same, {"t": same}, {"t": "demo"}, "t")
    )
    assert by_bytes["teacher_status"] == by_ids["teacher_status"] == ["aligned"] * len(words)
    for b in range(len(words)):
        labelled = [y != -100 for y in by_ids["labels"][b]]
        assert by_bytes["teacher_align"][b] == [EXACT if y else NONE for y in labelled]
        for p in range(len(labelled)):  # the same lists, up to the order of merged candidates
            got = dict(zip(by_bytes["teacher_topk_ids"][b][p], by_bytes["teacher_topk_logprobs"][b][p], strict=True))
            want = dict(zip(by_ids["teacher_topk_ids"][b][p], by_ids["teacher_topk_logprobs"][b][p], strict=True))
            assert got == pytest.approx(want)
    ids_batch, bytes_batch = _batch(by_ids, False), _batch(by_bytes, True)
    logits = torch.randn(*ids_batch["labels"].shape, len(char_tok), generator=torch.Generator().manual_seed(1))
    plain = losses.loss_sums(logits, ids_batch, True)
    cross = losses.loss_sums(logits, bytes_batch, True)
    assert cross["uld_groups"] == 0 and cross["exact_tokens"] == plain["kl_tokens"] == cross["kl_tokens"] > 0
    assert float(cross["kl_sum"]) == pytest.approx(float(plain["kl_sum"]), rel=1e-6)
    assert losses.distill_token_count(bytes_batch) == losses.distill_token_count(ids_batch) == plain["kl_tokens"]


def _uld_batch(lp_t: list[float], span: float, cont_label: int | None):
    """One row: a ULD group head at position 1 (its label 3), optionally a continuation at 2."""
    width = 4
    labels = torch.tensor([[-100, 3, cont_label if cont_label is not None else -100, -100]])
    align = torch.tensor([[NONE, ULD_HEAD, ULD_CONT if cont_label is not None else NONE, NONE]])
    k = len(lp_t)
    ids = torch.full((1, width, k), losses.ABSENT)
    lps = torch.zeros((1, width, k))
    ids[0, 1] = -1
    lps[0, 1] = torch.tensor(lp_t)
    spans = torch.zeros((1, width))
    spans[0, 1] = span
    return labels, ids, lps, align, spans


def test_uld_term_matches_a_hand_computation():
    torch.manual_seed(0)
    V = 6
    logits = torch.randn(1, 4, V)
    lp_t = [math.log(0.5), math.log(0.3)]  # the teacher's top-2; 0.2 in its tail
    span = math.log(0.8)  # the teacher's probability of the rest of the group
    labels, ids, lps, align, spans = _uld_batch(lp_t, span, cont_label=4)
    s, n = losses.uld_sum(logits, labels, lps, ids != losses.ABSENT, align, spans)
    q_head = torch.softmax(logits[0, 0], -1)  # logits at 0 predict the head's token (position 1)
    c_s = float(torch.softmax(logits[0, 1], -1)[4])  # ... and at 1 the continuation's (label 4)
    q_top = sorted(q_head.tolist(), reverse=True)[:2]
    c_t = 0.8
    want = abs(c_t * 0.5 - c_s * q_top[0]) + abs(c_t * 0.3 - c_s * q_top[1])
    want += abs(c_t * 0.2 - c_s * (1 - sum(q_top)))
    assert n == 1 and float(s) == pytest.approx(want, rel=1e-5)


def test_uld_is_vocabulary_free_and_zero_when_the_sorted_distributions_match():
    """ULD compares sorted probabilities: a permutation of the student's vocabulary changes nothing, and a student
    whose sorted distribution and group probability are the teacher's scores 0."""
    V = 7
    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(3)), -1)
    lp_sorted = p.sort(descending=True).values.log().tolist()
    labels, ids, lps, align, spans = _uld_batch(lp_sorted, 0.0, cont_label=None)
    logits = torch.zeros(1, 4, V)
    logits[0, 0] = p.log()[torch.randperm(V, generator=torch.Generator().manual_seed(4))]
    s, n = losses.uld_sum(logits, labels, lps, ids != losses.ABSENT, align, spans)
    assert n == 1 and float(s) == pytest.approx(0.0, abs=1e-6)
    logits[0, 0] = torch.randn(V)
    s1, _ = losses.uld_sum(logits, labels, lps, ids != losses.ABSENT, align, spans)
    logits[0, 0] = logits[0, 0, torch.randperm(V)]
    s2, _ = losses.uld_sum(logits, labels, lps, ids != losses.ABSENT, align, spans)
    assert float(s1) > 0.01 and float(s2) == pytest.approx(float(s1), rel=1e-5)


def test_the_labelled_head_gives_the_full_computation_with_both_parts(char_tok):
    """training.head keeps the labelled positions only; the exact and ULD sums (and their gradient) are the full
    computation's, the continuations still following their heads."""
    rows = _rows(char_tok, ["nvvqsz", "abc", "itssgx"])
    tmpl = resolve_template(char_tok, "auto")
    batch = {k: [r[k] for r in rows] for k in rows[0]}
    same = TokenizerBytes.from_tokenizer(char_tok, "demo")
    out = encode_batch(batch, char_tok, tmpl, EncodeSettings(64), CrossTokenizer(same, {"t": same}, {"t": "demo"}, "t"))
    b = _batch(out, True)
    # turn the first two answer tokens of every row into one ULD group (a teacher token spanning both)
    for r in range(b["labels"].size(0)):
        first = int((b["labels"][r] != -100).nonzero()[0])
        b[losses.TEACHER_ALIGN][r, first], b[losses.TEACHER_ALIGN][r, first + 1] = ULD_HEAD, ULD_CONT
        b[losses.TEACHER_IDS][r, first] = torch.where(
            b[losses.TEACHER_IDS][r, first] == losses.ABSENT, losses.ABSENT, -1
        )
        b[losses.TEACHER_LOGPROBS][r, first] = b[losses.TEACHER_LOGPROBS][r, first].sort(descending=True).values
        b[losses.TEACHER_SPAN][r, first] = -0.3
    full = torch.randn(
        *b["labels"].shape, len(char_tok), generator=torch.Generator().manual_seed(5), requires_grad=True
    )
    ref = losses.loss_sums(full, b, True)
    ref["kl_sum"].backward()
    keep, small = head.compact(b, LABEL_ALIGNED)
    x = full.detach().clone().requires_grad_(True)
    got = losses.loss_sums(x.index_select(1, keep), small, True)
    got["kl_sum"].backward()
    assert got["uld_groups"] == ref["uld_groups"] == 3 and got["exact_tokens"] == ref["exact_tokens"] > 0
    assert float(got["kl_sum"]) == pytest.approx(float(ref["kl_sum"]), rel=1e-6)
    assert torch.allclose(x.grad, full.grad, atol=1e-6) and torch.isfinite(full.grad).all()
