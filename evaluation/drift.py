"""Drift: the promoted model re-scored on the freshest held-out data, against its own promotion.

The decision is pure (:func:`decide`); :func:`score_promoted` runs the real model (imports
torch lazily). The fresh items are other items than the promotion-time ones, so the comparison is
unpaired: a suite DRIFTED when the interval of (fresh − promotion-time score), at the gate's
confidence, lies wholly below ``−max_drop`` (Newcombe's interval for 0/1 scores, Welch's t else), or
the fresh score's interval lies below the gate's floor (``evaluation.gate.min_score``). Too few fresh
or promotion-time items is INCONCLUSIVE, never a retraining trigger; otherwise STABLE. The
promotion-time per-item scores are the candidate's rows of its evaluation, kept next to
``promotion.json`` (``promotion_items.parquet``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

DRIFTED, STABLE, INCONCLUSIVE = "DRIFTED", "STABLE", "INCONCLUSIVE"
PROMOTION_ITEMS = "promotion_items.parquet"  # the candidate's item rows at promotion, next to promotion.json


class DriftError(RuntimeError):
    """The drift evaluation cannot run (no promoted model, unreadable promotion record)."""


@dataclass(frozen=True)
class SuiteDrift:
    suite: str
    score: float | None
    promoted_score: float | None
    items: int
    floor: float
    max_drop: float
    promoted_items: int = 0
    score_lo: float | None = None  # interval of the fresh score
    score_hi: float | None = None
    delta: float | None = None  # fresh − promotion-time, with its unpaired interval
    delta_lo: float | None = None
    delta_hi: float | None = None
    method: str = ""
    confidence: float = 0.95
    reasons: tuple[str, ...] = ()
    inconclusive: str | None = None


@dataclass(frozen=True)
class DriftReport:
    verdict: str
    suites: list[SuiteDrift] = field(default_factory=list)

    @property
    def reasons(self) -> list[str]:
        return [r for s in self.suites for r in s.reasons]

    def summary(self) -> str:
        if self.verdict == DRIFTED:
            return "; ".join(self.reasons)
        if self.verdict == INCONCLUSIVE:
            return "; ".join(f"{s.suite}: {s.inconclusive}" for s in self.suites if s.inconclusive)
        return "; ".join(
            f"{s.suite}: {s.score:.3f} (promoted at "
            f"{'n/a' if s.promoted_score is None else f'{s.promoted_score:.3f}'}"
            + (
                ""
                if s.delta_lo is None
                else f"; change [{s.delta_lo:+.3f}, {s.delta_hi:+.3f}] at "
                f"{s.confidence:.0%}, allowed drop {s.max_drop:.3f}"
            )
            + ")"
            for s in self.suites
        )

    def as_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "summary": self.summary(),
            "reasons": self.reasons,
            "suites": [asdict(s) for s in self.suites],
        }


def decide(
    fresh: dict[str, list[float]],
    promoted: dict[str, list[float] | None],
    floor: float,
    max_drop: float,
    min_items: int,
    confidence: float = 0.95,
) -> DriftReport:
    """``fresh``: suite -> per-item scores on fresh items; ``promoted``: suite -> the same model's per-item
    scores at promotion (other items, so the comparison is unpaired; None: not scored then).

    Per suite, at ``confidence``: DRIFTED when the interval of fresh − promotion-time excludes every drop
    up to ``max_drop`` (its upper end is below −max_drop), or when the fresh score's interval lies below
    the gate's ``floor``; INCONCLUSIVE with fewer than ``min_items`` fresh (or promotion-time) items;
    else STABLE. A point estimate is never judged alone: at 50 items and ~90% accuracy a 6-point
    difference is within noise."""
    from evaluation import stats

    suites = []
    for suite, scores in fresh.items():
        before = promoted.get(suite)
        n, nb = len(scores), len(before or [])
        mean = sum(scores) / n if n else None
        pmean = sum(before) / nb if nb else None
        common = {
            "suite": suite,
            "score": mean,
            "promoted_score": pmean,
            "items": n,
            "floor": floor,
            "max_drop": max_drop,
            "promoted_items": nb,
            "confidence": confidence,
        }
        if n < min_items:
            suites.append(
                SuiteDrift(
                    **common, inconclusive=f"{n} fresh scored item(s), fewer than the gate's min_items {min_items}"
                )
            )
            continue
        sc = stats.score_ci(scores, confidence)
        common |= {"score_lo": sc.lo, "score_hi": sc.hi}
        reasons = []
        if sc.hi < floor:
            reasons.append(
                f"{suite}: fresh score {mean:.3f} [{sc.lo:.3f}, {sc.hi:.3f}] is below the gate floor "
                f"{floor:.3f} ({n} items, {confidence:.0%})"
            )
        inconclusive = None
        if before is not None and nb < min_items:
            inconclusive = f"{nb} promotion-time scored item(s), fewer than the gate's min_items {min_items}"
        elif before is not None:
            d = stats.unpaired_difference(scores, before, confidence)
            common |= {"delta": d.estimate, "delta_lo": d.lo, "delta_hi": d.hi, "method": d.method}
            if d.hi < -max_drop:
                reasons.append(
                    f"{suite}: fresh score {mean:.3f} dropped {pmean - mean:.3f} from its promotion-time "
                    f"score {pmean:.3f}; the change is [{d.lo:+.3f}, {d.hi:+.3f}] at {confidence:.0%} "
                    f"({d.method}, {n} fresh vs {nb} promotion-time items), beyond the allowed drop "
                    f"{max_drop:.3f}"
                )
        suites.append(SuiteDrift(**common, reasons=tuple(reasons), inconclusive=None if reasons else inconclusive))
    if any(s.reasons for s in suites):
        verdict = DRIFTED
    elif any(s.inconclusive for s in suites) or not suites:
        verdict = INCONCLUSIVE
    else:
        verdict = STABLE
    return DriftReport(verdict, suites)


@dataclass(frozen=True)
class Promoted:
    key: str
    path: Path
    adapter_path: Path
    record: dict

    def candidate_scores(self) -> dict[str, float | None]:
        return dict(self.record.get("scores", {}).get("candidate", {}))

    def item_scores(self) -> dict[str, list[float]]:
        """suite -> the candidate's per-item scores at promotion (``promotion_items.parquet``; empty for a
        promotion recorded without them)."""
        import pyarrow.parquet as pq

        p = self.path / PROMOTION_ITEMS
        if not p.exists():
            return {}
        out: dict[str, list[float]] = {}
        for r in pq.read_table(p, columns=["suite", "score"]).to_pylist():
            if r["score"] is not None:
                out.setdefault(r["suite"], []).append(float(r["score"]))
        return out

    def base_model_path(self) -> Path | None:
        """The base the adapter was trained on: recorded relative to the artifact root the promoted folder lives in
        (``<root>/<campaign>/promoted_model/<key>``; evaluation/promotion.py), or absolute by older promotions."""
        p = self.record.get("base_model_path")
        return None if not p else Path(p) if Path(p).is_absolute() else self.path.parents[2] / p


def current_promoted(campaign_dir: Path) -> Promoted | None:
    """The campaign's promoted model (``promoted_model/CURRENT`` -> its directory), or None."""
    pointer = campaign_dir / "promoted_model" / "CURRENT"
    if not pointer.exists():
        return None
    key = pointer.read_text().strip()
    path = campaign_dir / "promoted_model" / key
    record_path = path / "promotion.json"
    try:
        record = json.loads(record_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DriftError(
            f"{pointer} points at {key!r} but {record_path} is unreadable ({e}); re-materialize promoted_model"
        ) from None
    if not (path / "adapter").is_dir():
        raise DriftError(f"promoted model {key!r} has no adapter directory at {path / 'adapter'}")
    return Promoted(key, path, path / "adapter", record)


def local_generate(base_model: Path, adapter: Path, load_in_4bit: bool, compute_dtype: str, batch_size: int):
    """``generate(prompts, max_new_tokens)`` of base + adapter loaded here (imports torch)."""
    from campaign_orchestrator.generation.local import LocalModel

    return LocalModel.from_path(base_model, adapter, load_in_4bit, compute_dtype, batch_size=batch_size).generate


def score_promoted(
    generate, suites: list, log: Callable[[str], None] = print, progress: Callable[[int], None] | None = None
) -> tuple[dict[str, list[float]], list[dict]]:
    """Score every suite (objects with ``name``, ``items``, ``scorer``, ``max_new_tokens``) with the
    promoted model's ``generate`` (local, or the evaluation endpoint). Returns suite -> per-item scores
    (errors left out: never a wrong answer) and the per-item rows (``evaluation.suite`` schema);
    ``progress(n)`` after each suite (a budget watch may stop there)."""
    from evaluation.suite import run_suite

    scores, rows = {}, []
    for s in suites:
        results, r = run_suite(s.name, "promoted", s.items, generate, s.scorer, s.max_new_tokens)
        rows += r
        scores[s.name] = [x.score for x in results if x.score is not None]
        n = len(scores[s.name])
        log(f"promoted model on fresh {s.name}: score {sum(scores[s.name]) / n if n else None} on {n} item(s)")
        if progress is not None:
            progress(len(r))
    return scores, rows
