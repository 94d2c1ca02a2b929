"""Statistics against hand-computed values."""

import math

import pytest

from evaluation import stats


def test_wilson_matches_hand_computed_interval():
    # 8 of 10: p = 0.8, z = 1.959964; center = (0.8 + z²/20) / (1 + z²/10), half = z·sqrt(p(1-p)/10 + z²/400) / (1 +
    # z²/10)
    iv = stats.wilson(8, 10)
    assert iv.estimate == 0.8
    assert iv.lo == pytest.approx(0.4902, abs=1e-4)
    assert iv.hi == pytest.approx(0.9433, abs=1e-4)
    # 0 of n: the upper bound is z² / (n + z²) exactly
    z2 = 1.959963984540054**2
    none = stats.wilson(0, 200)
    assert (none.lo, none.hi) == (0.0, pytest.approx(z2 / (200 + z2)))
    assert stats.wilson(200, 200).hi == 1.0
    assert not stats.wilson(0, 0).defined


def test_paired_t_matches_hand_computed_interval():
    # differences 1,0,1,1,0: mean 0.6, sd sqrt(0.3), se 0.24495, t(0.975, 4) = 2.776445
    iv = stats.paired_difference([1, 0, 1, 1, 0], [0, 0, 0, 0, 0], method=stats.PAIRED_T)
    assert iv.estimate == pytest.approx(0.6)
    assert iv.lo == pytest.approx(0.6 - 2.776445 * math.sqrt(0.3 / 5), abs=1e-5)
    assert iv.hi == pytest.approx(0.6 + 2.776445 * math.sqrt(0.3 / 5), abs=1e-5)
    assert not stats.paired_difference([1], [0], method=stats.PAIRED_T).defined


def test_paired_bootstrap_matches_the_exact_resampling_distribution():
    # differences (0, 0, 1): a resample's mean is K/3 with K ~ Binomial(3, 1/3):
    # P(0) = 8/27 = .296, P(1/3) = 12/27, P(2/3) = 6/27 (cumulative .963), P(1) = 1/27.
    # So the 90% interval is [0, 2/3] and the 95% interval is [0, 1].
    cand, base = [1, 0, 1], [1, 0, 0]
    iv90 = stats.paired_difference(cand, base, confidence=0.90, resamples=20_000, seed=7)
    assert (iv90.estimate, iv90.lo, iv90.hi) == (pytest.approx(1 / 3), 0.0, pytest.approx(2 / 3))
    iv95 = stats.paired_difference(cand, base, confidence=0.95, resamples=20_000, seed=7)
    assert (iv95.lo, iv95.hi) == (0.0, 1.0)
    # constant differences have a degenerate interval; the pairing matters (unpaired they would not)
    same = stats.paired_difference([1, 1, 0, 0], [0, 0, -1, -1], seed=1)
    assert (same.lo, same.hi) == (1.0, 1.0)


def test_bootstrap_is_reproducible_with_its_seed_and_close_to_t_on_many_items():
    cand = [1.0] * 150 + [0.0] * 250
    base = [1.0] * 100 + [0.0] * 50 + [1.0] * 60 + [0.0] * 190
    a = stats.paired_difference(cand, base, seed=3)
    assert a == stats.paired_difference(cand, base, seed=3)
    d = [c - b for c, b in zip(cand, base, strict=False)]
    assert (stats.bootstrap_means(d, 500, 3) != stats.bootstrap_means(d, 500, 4)).any()
    t = stats.paired_difference(cand, base, method=stats.PAIRED_T)
    assert a.estimate == pytest.approx(t.estimate) == pytest.approx(-10 / 400)  # 50 wins, 60 losses
    assert a.lo == pytest.approx(t.lo, abs=0.01) and a.hi == pytest.approx(t.hi, abs=0.01)
    with pytest.raises(ValueError, match="same items"):
        stats.paired_difference([1, 0], [1])


def test_mcnemar_exact_on_a_known_table_and_win_loss_tie():
    # 10 discordant pairs favour the candidate, 2 the base: p = 2·P(X ≤ 2 | 12, ½) = 2·79/4096
    assert stats.mcnemar_exact(10, 2) == pytest.approx(158 / 4096)
    assert stats.mcnemar_exact(2, 10) == pytest.approx(158 / 4096)
    assert stats.mcnemar_exact(5, 5) == 1.0
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.win_loss_tie([1, 1, 0, 0, 0.5], [0, 1, 1, 0, 0.25]) == stats.WinLossTie(2, 1, 2)


def test_score_interval_uses_wilson_for_binary_and_bootstrap_otherwise():
    assert stats.score_ci([1, 0, 1, 1]).method == "wilson"
    cont = stats.score_ci([0.2, 0.4, 0.6, 0.8], seed=0)
    assert cont.method == "bootstrap" and cont.lo < 0.5 < cont.hi
    assert stats.score_ci([0.2, 0.4, 0.6, 0.8], method=stats.PAIRED_T).method == "t"


def test_count_resampling_matches_index_resampling():
    # 0/1 differences go through multinomial counts; the same values made distinct by a tiny
    # jitter go through index resampling: the two intervals agree
    d = [1.0] * 30 + [-1.0] * 12 + [0.0] * 158
    fast = stats.bootstrap_ci(d, resamples=20_000, seed=0)
    slow = stats.bootstrap_ci([v + i * 1e-12 for i, v in enumerate(d)], resamples=20_000, seed=0)
    assert fast.lo == pytest.approx(slow.lo, abs=0.006) and fast.hi == pytest.approx(slow.hi, abs=0.006)
