"""The on-policy loss (generalized JSD of GKD on the teacher's top-k plus a tail bucket) against references:
a direct computation written out position by position, and, with k = vocabulary, TRL's own
``GKDTrainer.generalized_jsd_loss``."""

from __future__ import annotations

import ast
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from training import losses

B, T, V, K = 2, 6, 11, 3


def _batch(seed: int = 0, k: int = K):
    """Student logits, labels (prompt positions masked, one row shorter) and the teacher's top-k aligned with
    labels (index t: the distribution over the token at t), from a full teacher distribution."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, T, V, generator=g) * 2
    teacher = torch.randn(B, T, V, generator=g) * 2
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :2] = -100
    labels[1, -1] = -100
    lp = torch.log_softmax(teacher, -1)
    vals, idx = lp[:, :-1].topk(k, dim=-1)  # position t predicts the token at t + 1
    ids = torch.full((B, T, k), -1, dtype=torch.long)
    lps = torch.zeros((B, T, k))
    ids[:, 1:], lps[:, 1:] = idx, vals
    ids[0, 3, -1] = -1  # one position with a shorter list
    return student, teacher, labels, ids, lps


def _direct(student, labels, ids, lps, beta: float) -> tuple[float, int]:
    """The divergence written out: per labelled position, the K + 1 buckets as Python floats."""
    total, n = 0.0, 0
    for b in range(B):
        for t in range(1, T):
            if labels[b, t] == -100:
                continue
            q_all = torch.softmax(student[b, t - 1].double(), -1).tolist()
            top = [(int(i), math.exp(float(v))) for i, v in zip(ids[b, t], lps[b, t], strict=False) if i >= 0]
            p = [pi for _, pi in top] + [max(1 - sum(pi for _, pi in top), 1e-12)]
            q = [q_all[i] for i, _ in top] + [sum(x for j, x in enumerate(q_all) if j not in {i for i, _ in top})]

            def kl(a, c):
                return sum(x * (math.log(x) - math.log(y)) for x, y in zip(a, c, strict=False) if x > 0)

            m = [beta * x + (1 - beta) * y for x, y in zip(p, q, strict=False)]
            d = kl(p, q) if beta == 0 else kl(q, p) if beta == 1 else beta * kl(p, m) + (1 - beta) * kl(q, m)
            total, n = total + d, n + 1
    return total, n


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_generalized_jsd_equals_direct_computation(beta):
    student, _, labels, ids, lps = _batch()
    got, n = losses.generalized_jsd_sum(student, labels, ids, lps, beta)
    want, n_want = _direct(student, labels, ids, lps, beta)
    assert n == n_want == 7
    assert float(got) == pytest.approx(want, rel=1e-5)
    assert float(got) > 0


def test_forward_kl_is_the_logit_loss():
    student, _, labels, ids, lps = _batch(1)
    got, _ = losses.generalized_jsd_sum(student, labels, ids, lps, 0.0)
    kl, _ = losses.topk_kl_sum(student, labels, ids, lps)
    assert float(got) == pytest.approx(float(kl), rel=1e-6)


def _trl_generalized_jsd_loss():
    """TRL's function, read from its installed source without importing TRL (importing its trainer module pulls
    in transformers' Trainer, accelerate and datasets: ~10 s): the function body uses only torch and F."""
    spec = importlib.util.find_spec("trl")  # a top-level package: found without being imported
    path = Path(spec.origin).parent / "experimental" / "gkd" / "gkd_trainer.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "generalized_jsd_loss")
    fn.decorator_list = []
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace["generalized_jsd_loss"]


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
def test_top_k_of_the_whole_vocabulary_equals_trl(beta):
    """k = V: no tail, the exact divergence, equal to TRL's ``generalized_jsd_loss`` (same beta convention: 0
    forward KL, 1 reverse KL) summed over the same label positions; gradients too."""
    trl_loss = _trl_generalized_jsd_loss()
    student, teacher, labels, ids, lps = _batch(2, k=V)
    vals, idx = torch.log_softmax(teacher, -1)[:, :-1].topk(V, -1)
    ids[:, 1:], lps[:, 1:] = idx, vals  # every position lists the whole vocabulary (no shorter list)
    mine_in = student.clone().requires_grad_(True)
    ref_in = student.clone().requires_grad_(True)
    got, n = losses.generalized_jsd_sum(mine_in, labels, ids, lps, beta)
    want = trl_loss(ref_in[:, :-1], teacher[:, :-1], labels=labels[:, 1:], beta=beta, reduction="sum")
    assert n == int((labels[:, 1:] != -100).sum())
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    got.backward()
    want.backward()
    torch.testing.assert_close(mine_in.grad, ref_in.grad, rtol=1e-4, atol=1e-6)


def test_positions_without_teacher_and_masked_labels_drop_out():
    student, _, labels, ids, lps = _batch(3)
    ids[:, :, :] = -1
    got, n = losses.generalized_jsd_sum(student.requires_grad_(True), labels, ids, lps, 1.0)
    assert n == 0 and float(got) == 0.0
    got.backward()  # still part of the graph: every rank runs backward
    assert float(student.grad.abs().sum()) == 0.0


def test_confident_student_off_the_teacher_top_k_stays_finite():
    student, _, labels, ids, lps = _batch(4)
    student[:, :, 0] = 80.0  # the student puts all its mass on token 0, outside the teacher's top-k
    ids[(ids == 0)] = 1
    for beta in (0.0, 0.5, 1.0):
        x = student.clone().requires_grad_(True)
        got, _ = losses.generalized_jsd_sum(x, labels, ids, lps, beta)
        got.backward()
        assert math.isfinite(float(got)) and bool(torch.isfinite(x.grad).all()), beta
