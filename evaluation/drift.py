"""Drift: the promoted model re-scored on the freshest held-out data, against its own promotion.

The decision is pure (:func:`decide`); :func:`score_promoted` runs the real model (imports
torch lazily). A suite drifts when its fresh score falls below the gate's floor
(``evaluation.gate.min_score``) or more than ``max_drop`` below the score the same adapter had
when it was promoted (``promotion.json``). Too few fresh items is INCONCLUSIVE, never a
retraining trigger.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

DRIFTED, STABLE, INCONCLUSIVE = "DRIFTED", "STABLE", "INCONCLUSIVE"


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
        return "; ".join(f"{s.suite}: {s.score:.3f} (promoted at {s.promoted_score if s.promoted_score is not None else 'n/a'})"
                         for s in self.suites)

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "summary": self.summary(), "reasons": self.reasons,
                "suites": [asdict(s) for s in self.suites]}


def decide(fresh: dict[str, tuple[float | None, int]], promoted: dict[str, float | None], floor: float, max_drop: float,
           min_items: int) -> DriftReport:
    """``fresh``: suite -> (score on fresh items, number of scored items); ``promoted``: suite ->
    score at promotion time (missing or None: only the floor applies)."""
    suites = []
    for suite, (score, items) in fresh.items():
        before = promoted.get(suite)
        if score is None or items < min_items:
            suites.append(SuiteDrift(suite, score, before, items, floor, max_drop,
                                     inconclusive=f"{items} fresh scored item(s), fewer than the gate's min_items {min_items}"))
            continue
        reasons = []
        if score < floor:
            reasons.append(f"{suite}: fresh score {score:.3f} is below the gate floor {floor:.3f} ({items} items)")
        if before is not None and before - score > max_drop + 1e-12:
            reasons.append(f"{suite}: fresh score {score:.3f} dropped {before - score:.3f} from its promotion-time "
                           f"score {before:.3f} (allowed drop {max_drop:.3f})")
        suites.append(SuiteDrift(suite, score, before, items, floor, max_drop, tuple(reasons)))
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

    def base_model_path(self) -> Path | None:
        p = self.record.get("base_model_path")
        return Path(p) if p else None


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
        raise DriftError(f"{pointer} points at {key!r} but {record_path} is unreadable ({e}); re-materialize "
                         f"promoted_model") from None
    if not (path / "adapter").is_dir():
        raise DriftError(f"promoted model {key!r} has no adapter directory at {path / 'adapter'}")
    return Promoted(key, path, path / "adapter", record)


def score_promoted(base_model: Path, adapter: Path, suites: list, load_in_4bit: bool, compute_dtype: str,
                   batch_size: int, log: Callable[[str], None] = print) -> tuple[dict[str, tuple[float | None, int]], list[dict]]:
    """Load base + adapter once and score every suite (objects with ``name``, ``items``, ``scorer``,
    ``max_new_tokens``). Returns suite -> (mean score over scored items, scored items) and the
    per-item rows (``evaluation.suite`` schema)."""
    from evaluation.suite import run_suite
    from campaign_orchestrator.teacher.local import LocalGenerator

    gen = LocalGenerator.from_path(base_model, adapter, load_in_4bit, compute_dtype, batch_size=batch_size)
    scores, rows = {}, []
    for s in suites:
        results, r = run_suite(s.name, "promoted", s.items, gen.generate, s.scorer, s.max_new_tokens)
        rows += r
        scored = [x.score for x in results if x.score is not None]
        scores[s.name] = (sum(scored) / len(scored) if scored else None, len(scored))
        log(f"promoted model on fresh {s.name}: score {scores[s.name][0]} on {len(scored)} item(s)")
    return scores, rows
