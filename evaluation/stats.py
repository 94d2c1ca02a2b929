"""Statistics a gate can defend: intervals of scores and of paired differences, win/loss/tie
counts and McNemar's test. numpy and scipy only; every function is deterministic.

Conventions (the report states them):

- score of one model: Wilson score interval when every score is 0 or 1, else a percentile
  bootstrap of the mean (or Student's t, following the campaign's interval method);
- candidate − base: the same items, so the interval is on the per-item differences, by a
  percentile **paired bootstrap** (resample items, keep each item's pair together) or a
  **paired t** interval;
- McNemar: the exact two-sided binomial test on the discordant pairs (wins, losses), valid at
  any sample size (the chi-square approximation is not, for few discordant pairs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as st

PAIRED_BOOTSTRAP, PAIRED_T = "paired_bootstrap", "paired_t"
_MAX_CELLS = 4_000_000  # resample indices drawn per chunk (memory bound: 32 MB of int64)
_FEW_VALUES = 16  # at most this many distinct values: resample counts (multinomial), not indices


@dataclass(frozen=True)
class Interval:
    estimate: float
    lo: float
    hi: float
    method: str
    confidence: float

    @property
    def defined(self) -> bool:
        return not (math.isnan(self.lo) or math.isnan(self.hi))

    def as_dict(self) -> dict:
        return asdict(self)


def _nan(method: str, confidence: float, estimate: float = math.nan) -> Interval:
    return Interval(estimate, math.nan, math.nan, method, confidence)


def is_binary(values: Sequence[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def wilson(successes: int, n: int, confidence: float = 0.95) -> Interval:
    """Wilson score interval of a proportion (good at 0% and 100%, unlike the normal one)."""
    if n == 0:
        return _nan("wilson", confidence)
    z = float(st.norm.ppf(0.5 + confidence / 2))
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes == 0 else max(0.0, center - half)
    hi = 1.0 if successes == n else min(1.0, center + half)
    return Interval(p, lo, hi, "wilson", confidence)


def bootstrap_means(values: Sequence[float], resamples: int, seed: int) -> np.ndarray:
    """Means of ``resamples`` resamples (with replacement, same size) of ``values``.

    With few distinct values (0/1 scores, their paired differences) a resample is drawn as the
    multinomial counts of those values, the same distribution as drawing item indices, in O(1)
    per resample instead of O(n)."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    rng = np.random.default_rng(seed)
    distinct, counts = np.unique(x, return_counts=True)
    if len(distinct) <= _FEW_VALUES:
        return rng.multinomial(n, counts / n, size=resamples) @ distinct / n
    out = np.empty(resamples, dtype=np.float64)
    chunk = max(1, _MAX_CELLS // max(n, 1))
    for start in range(0, resamples, chunk):
        b = min(chunk, resamples - start)
        out[start : start + b] = x[rng.integers(0, n, size=(b, n))].mean(axis=1)
    return out


def bootstrap_ci(
    values: Sequence[float], confidence: float = 0.95, resamples: int = 10_000, seed: int = 0, method: str = "bootstrap"
) -> Interval:
    """Percentile bootstrap interval of the mean of ``values``."""
    if len(values) == 0:
        return _nan(method, confidence)
    means = bootstrap_means(values, resamples, seed)
    alpha = 1 - confidence
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return Interval(float(np.mean(values)), float(lo), float(hi), method, confidence)


def t_ci(values: Sequence[float], confidence: float = 0.95, method: str = "t") -> Interval:
    """Student's t interval of the mean (undefined for fewer than two values)."""
    n = len(values)
    if n == 0:
        return _nan(method, confidence)
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if n < 2:
        return _nan(method, confidence, mean)
    se = float(x.std(ddof=1)) / math.sqrt(n)
    half = float(st.t.ppf(0.5 + confidence / 2, n - 1)) * se
    return Interval(mean, mean - half, mean + half, method, confidence)


def score_ci(
    values: Sequence[float],
    confidence: float = 0.95,
    method: str = PAIRED_BOOTSTRAP,
    resamples: int = 10_000,
    seed: int = 0,
) -> Interval:
    """Interval of one model's mean score: Wilson for 0/1 scores, else bootstrap or t."""
    if values and is_binary(values):
        return wilson(int(sum(values)), len(values), confidence)
    if method == PAIRED_T:
        return t_ci(values, confidence)
    return bootstrap_ci(values, confidence, resamples, seed)


def paired_difference(
    candidate: Sequence[float],
    base: Sequence[float],
    confidence: float = 0.95,
    method: str = PAIRED_BOOTSTRAP,
    resamples: int = 10_000,
    seed: int = 0,
) -> Interval:
    """Interval of mean(candidate − base) over the same items, in the same order."""
    if len(candidate) != len(base):
        raise ValueError(f"paired scores need the same items: {len(candidate)} candidate vs {len(base)} base")
    d = [c - b for c, b in zip(candidate, base, strict=True)]
    if method == PAIRED_T:
        return t_ci(d, confidence, PAIRED_T)
    if method == PAIRED_BOOTSTRAP:
        return bootstrap_ci(d, confidence, resamples, seed, PAIRED_BOOTSTRAP)
    raise ValueError(f"unknown interval method {method!r}; expected {PAIRED_BOOTSTRAP!r} or {PAIRED_T!r}")


def unpaired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Interval:
    """Interval of mean(a) − mean(b) over two independent sets of items (different items: nothing to
    pair). 0/1 scores: Newcombe's hybrid score interval (from the two Wilson intervals; sound at 90-100%
    accuracy, where the normal approximation collapses); other scores: Welch's t interval."""
    na, nb = len(a), len(b)
    if na == 0 or nb == 0:
        return _nan("unpaired", confidence)
    if is_binary(a) and is_binary(b):
        wa, wb = wilson(int(sum(a)), na, confidence), wilson(int(sum(b)), nb, confidence)
        d = wa.estimate - wb.estimate
        lo = d - math.sqrt((wa.estimate - wa.lo) ** 2 + (wb.hi - wb.estimate) ** 2)
        hi = d + math.sqrt((wa.hi - wa.estimate) ** 2 + (wb.estimate - wb.lo) ** 2)
        return Interval(d, lo, hi, "newcombe (unpaired, Wilson)", confidence)
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    d = float(x.mean() - y.mean())
    if na < 2 or nb < 2:
        return _nan("welch t (unpaired)", confidence, d)
    va, vb = float(x.var(ddof=1)) / na, float(y.var(ddof=1)) / nb
    se = math.sqrt(va + vb)
    if se == 0:
        return Interval(d, d, d, "welch t (unpaired)", confidence)
    df = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    half = float(st.t.ppf(0.5 + confidence / 2, df)) * se
    return Interval(d, d - half, d + half, "welch t (unpaired)", confidence)


@dataclass(frozen=True)
class WinLossTie:
    wins: int  # candidate better than base on the item
    losses: int  # candidate worse
    ties: int


def win_loss_tie(candidate: Sequence[float], base: Sequence[float]) -> WinLossTie:
    w = sum(1 for c, b in zip(candidate, base, strict=True) if c > b)
    ls = sum(1 for c, b in zip(candidate, base, strict=True) if c < b)
    return WinLossTie(w, ls, len(candidate) - w - ls)


def mcnemar_exact(wins: int, losses: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of ``wins`` among the discordant pairs at 1/2."""
    n = wins + losses
    if n == 0:
        return 1.0
    return float(st.binomtest(wins, n, 0.5, alternative="two-sided").pvalue)
