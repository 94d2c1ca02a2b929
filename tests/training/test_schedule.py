"""The learning-rate schedule (training/schedule.py): linear warmup, cosine decay, zero after the end."""

import math

import pytest

from training.schedule import cosine_with_warmup


def test_warmup_rises_linearly_then_cosine_decays_to_zero():
    f = cosine_with_warmup(4, 12)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # the first step already trains
    assert f(4) == 1.0  # the peak, where the cosine starts
    assert f(8) == pytest.approx(0.5)  # half way through the decay
    assert f(12) == pytest.approx(0.0, abs=1e-12) and f(50) == pytest.approx(0.0, abs=1e-12)
    decay = [f(s) for s in range(4, 13)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))


def test_no_warmup_and_a_single_step():
    f = cosine_with_warmup(0, 10)
    assert f(0) == 1.0 and f(5) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cosine_with_warmup(0, 1)(0) == 1.0
    assert cosine_with_warmup(3, 2)(1) == pytest.approx(2 / 3)  # warmup longer than the run: still rising


def test_drives_lambda_lr_like_the_trainer():
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(2, 6))
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:3] == [1.0, 2.0, 2.0] and lrs[3] == pytest.approx(1.0 + math.cos(math.pi * 0.25))


def test_refuses_a_run_without_steps():
    with pytest.raises(ValueError, match="total_steps >= 1"):
        cosine_with_warmup(0, 0)
