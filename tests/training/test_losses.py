"""Loss functions and teacher top-k alignment, on synthetic tensors (no model)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from training import losses


def _dense_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    p = F.log_softmax(p_logits, -1)
    q = F.log_softmax(q_logits, -1)
    return (p.exp() * (p - q)).sum(-1)


def _topk_batch(teacher_logits: torch.Tensor, k: int):
    lp = F.log_softmax(teacher_logits, -1)
    vals, ids = lp.topk(k, dim=-1)
    return ids, vals


def test_cross_entropy_sum_matches_mean_times_count():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    labels = torch.tensor([[-100, -100, 3, 4, 5, -100], [-100, 1, 2, -100, -100, -100]])
    s, n = losses.cross_entropy_sum(logits, labels)
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert n == 5
    assert float(s) == pytest.approx(float(ref) * n, rel=1e-6)


def test_topk_kl_with_the_whole_vocabulary_is_the_exact_kl():
    torch.manual_seed(1)
    V = 9
    student, teacher = torch.randn(2, 5, V), torch.randn(2, 5, V)
    labels = torch.tensor([[-100, 1, 2, 3, 4], [-100, -100, 5, 6, -100]])
    ids, lps = _topk_batch(teacher, V)
    s, n = losses.topk_kl_sum(student, labels, ids, lps)
    # position t of the teacher tensors is the distribution over token t, predicted from logits t-1
    mask = labels[:, 1:] != -100
    ref = _dense_kl(teacher[:, 1:], student[:, :-1])[mask].sum()
    assert n == int(mask.sum()) == 6
    assert float(s) == pytest.approx(float(ref), rel=1e-5, abs=1e-6)


def test_topk_kl_tail_bucket_and_zero_when_distributions_agree():
    torch.manual_seed(2)
    V, K = 12, 3
    teacher = torch.randn(1, 4, V) * 3
    labels = torch.tensor([[-100, 1, 2, 3]])
    ids, lps = _topk_batch(teacher, K)
    # manual: top-k terms plus one bucket for the rest
    student = torch.randn(1, 4, V)
    q = F.log_softmax(student[:, :-1], -1)
    total = 0.0
    for t in range(3):
        tid, tlp = ids[0, t + 1], lps[0, t + 1]
        p_top = tlp.exp()
        q_top = q[0, t, tid]
        tail_p = 1 - p_top.sum()
        tail_q = 1 - q_top.exp().sum()
        total += float((p_top * (tlp - q_top)).sum() + tail_p * (tail_p.log() - tail_q.log()))
    s, n = losses.topk_kl_sum(student, labels, ids, lps)
    assert n == 3 and float(s) == pytest.approx(total, rel=1e-5)
    # a student equal to the teacher has zero loss, and a zero gradient
    same = torch.zeros(1, 4, V, requires_grad=True)
    with torch.no_grad():
        same[:, :-1] = teacher[:, 1:]
    s0, _ = losses.topk_kl_sum(same, labels, ids, lps)
    s0.backward()
    assert abs(float(s0)) < 1e-5 and float(same.grad.abs().max()) < 1e-5


def test_topk_kl_masks_positions_without_teacher_and_stays_finite_for_a_confident_student():
    V = 6
    student = torch.full((1, 4, V), -30.0)
    student[..., 0] = 30.0  # the student puts all mass on token 0
    student.requires_grad_(True)
    labels = torch.tensor([[-100, 0, 0, 0]])
    ids = torch.tensor([[[-1, -1], [0, 1], [0, 1], [-1, -1]]])  # last label position has no teacher data
    lps = torch.log(torch.tensor([[[1.0, 1.0], [0.5, 0.3], [0.5, 0.3], [1.0, 1.0]]]))
    s, n = losses.topk_kl_sum(student, labels, ids, lps)
    assert n == 2 and math.isfinite(float(s)) and float(s) > 0
    s.backward()
    assert torch.isfinite(student.grad).all()


def test_topk_kl_rejects_ids_outside_the_student_vocabulary_and_bad_shapes():
    labels = torch.tensor([[-100, 1, 2]])
    with pytest.raises(ValueError, match="outside the student's vocabulary of 5"):
        losses.topk_kl_sum(torch.randn(1, 3, 5), labels, torch.full((1, 3, 2), 7), torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match="aligned with labels"):
        losses.topk_kl_sum(torch.randn(1, 3, 5), labels, torch.zeros(1, 2, 2, dtype=torch.long), torch.zeros(1, 2, 2))


def test_mix_weights_each_term_by_its_own_token_count():
    ce, kl = torch.tensor(12.0), torch.tensor(3.0)
    assert float(losses.mix(ce, 4, kl, 2, 0.25)) == pytest.approx(0.75 * 3 + 0.25 * 1.5)
    assert float(losses.mix(ce, 4, None, 0, 0.0)) == pytest.approx(3.0)
    assert float(losses.mix(ce, 0, kl, 3, 0.5)) == pytest.approx(0.5)  # no CE token: that term drops out


def _top(*ids):
    return [{"token_id": i, "logprob": -0.1 * (j + 1)} for j, i in enumerate(ids)]


def test_align_top_logprobs_places_lists_on_label_positions():
    labels = [-100, -100, -100, 7, 8, 2]  # bos, prompt, prompt, completion 7 8, eos 2
    with_eos = [_top(7, 9), _top(8, 9), _top(2, 7)]
    ids, lps = losses.align_top_logprobs(labels, with_eos, generated_ids=[7, 8, 2])
    assert ids == [[], [], [], [7, 9], [8, 9], [2, 7]]
    assert lps[3] == pytest.approx([-0.1, -0.2])
    ids, _ = losses.align_top_logprobs(labels, with_eos[:2])  # the teacher stopped without EOS
    assert ids == [[], [], [], [7, 9], [8, 9], []]
    t_ids, t_lps = losses.teacher_topk_tensors([ids], [_], width=7)
    assert t_ids.shape == (1, 7, 2) and t_ids[0, 3].tolist() == [7, 9] and t_ids[0, 5].tolist() == [-1, -1]


def test_align_top_logprobs_explains_mismatches():
    labels = [-100, -100, 7, 8, 2]
    with pytest.raises(losses.AlignmentError, match="3 label tokens but the generation has 1"):
        losses.align_top_logprobs(labels, [_top(7)], row="r1")
    with pytest.raises(losses.AlignmentError, match=r"completion token 1 \(row r2\) is 8 .* teacher generated 5"):
        losses.align_top_logprobs(labels, [_top(7), _top(5), _top(2)], generated_ids=[7, 5, 2], row="r2")


def test_padding_entries_do_not_hide_a_real_top_k_token():
    """A position with fewer than K teacher entries pads with -1; padding must not unmark token 0."""
    V = 5
    student = torch.randn(1, 2, V)
    labels = torch.tensor([[-100, 0]])
    ids = torch.tensor([[[-1, -1, -1], [0, -1, -1]]])
    lps = torch.tensor([[[0.0, 0.0, 0.0], [math.log(0.6), 0.0, 0.0]]])
    s, n = losses.topk_kl_sum(student, labels, ids, lps)
    q = F.log_softmax(student[0, 0], -1)
    tail_q = torch.logsumexp(q[1:], -1)
    ref = 0.6 * (math.log(0.6) - q[0]) + 0.4 * (math.log(0.4) - tail_q)
    assert n == 1 and float(s) == pytest.approx(float(ref), rel=1e-5)


def test_example_weights_give_each_packed_or_padded_example_one_vote():
    I = losses.IGNORE  # noqa: E741
    # one packed row of three examples (position_ids restart at 0): 2, 0 and 3 loss labels; then a padded row of
    # one example with 1 loss label and two pads (their own run of positions, no labels)
    labels = torch.tensor([[I, I, 5, 6, I, I, I, 7, 8, 9], [I, I, 4, I, I, I, I, I, I, I]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])
    w, n = losses.example_weights(labels, pos)
    assert n == 3  # the example without a loss label has no vote
    assert w.shape == labels.shape  # aligned with the labels (position 0 is never predicted: weight 0)
    assert w[0].tolist() == pytest.approx([0, 0, 0.5, 0.5, 0, 0, 0, 1 / 3, 1 / 3, 1 / 3])
    assert w[1].tolist() == pytest.approx([0, 0, 1, 0, 0, 0, 0, 0, 0, 0])
    # the weighted sum over the three examples is the sum of their mean losses
    torch.manual_seed(0)
    logits = torch.randn(2, 10, 11)
    per = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=I, reduction="none")
    per = per.view(2, 9)
    means = [per[0, 1:3].mean(), per[0, 6:9].mean(), per[1, 1]]
    got = losses.weighted_cross_entropy_sum(logits, labels, w)
    assert float(got) == pytest.approx(float(sum(means)), rel=1e-6)
    # the token mean weighs the three-token example three times the one-token one; the example mean does not
    assert float(got) / n != pytest.approx(float(per[labels[:, 1:] != I].mean()), rel=1e-3)
