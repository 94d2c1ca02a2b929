"""Baselines: a rung's numbers from a known-good run, and the comparison that names what moved.

A baseline is one JSON file per rung and cluster shape (``<dir>/<rung>-<shape>.json``): the
metrics (numbers), the environment fingerprint (versions, driver, devices) and when it was taken.
Every run is also appended to ``<rung>-<shape>.history.jsonl``. The first run of a shape records
the baseline; later runs are compared with it and never overwrite it, unless asked to rebaseline
(after an intended change: new hardware, a driver upgrade that was checked).

A :class:`Rule` says which direction is worse and by how much a metric may move:
``plateau_busbw_gbps`` may drop by 25%, ``latency_floor_us`` may rise by 50%, and so on. A
finding names the metric, both values, the relative change and the threshold, plus the
environment changes since the baseline that could explain it. A move beyond the threshold in
the *better* direction does not fail the verdict but is reported as an improvement (a warning:
a driver or config change moved the numbers; rebaseline if it was intended).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Rule:
    higher_is_better: bool
    threshold: float  # allowed relative move in the worse direction (0.25 = 25%); beyond it the other way: a warning


@dataclass(frozen=True)
class Change:
    metric: str
    baseline: float
    current: float
    relative: float  # (current - baseline) / baseline
    threshold: float
    higher_is_better: bool

    @property
    def improved(self) -> bool:
        return (self.relative > 0) == self.higher_is_better

    def message(self) -> str:
        if self.improved:
            return (
                f"{self.metric} improved {abs(self.relative):.0%}: rebaseline if intended (campaign ladder "
                f"--rebaseline); {self.baseline:.6g} → {self.current:.6g} (threshold {self.threshold:.0%})"
            )
        word = "dropped" if self.relative < 0 else "rose"
        return (
            f"{self.metric} {word} {abs(self.relative):.0%}: {self.baseline:.6g} → {self.current:.6g} "
            f"(allowed: {'-' if self.higher_is_better else '+'}{self.threshold:.0%})"
        )


def _moves(current: dict[str, float], baseline: dict[str, float], rules: dict[str, Rule], better: bool) -> list[Change]:
    out = []
    for metric, rule in rules.items():
        if metric not in current or metric not in baseline:
            continue
        b, c = float(baseline[metric]), float(current[metric])
        if b == 0:
            continue
        rel = (c - b) / abs(b)
        worse = -rel if rule.higher_is_better else rel
        if (-worse if better else worse) > rule.threshold:
            out.append(Change(metric, b, c, rel, rule.threshold, rule.higher_is_better))
    return out


def compare(current: dict[str, float], baseline: dict[str, float], rules: dict[str, Rule]) -> list[Change]:
    """Metrics that moved beyond their rule's threshold in the worse direction."""
    return _moves(current, baseline, rules, better=False)


def improvements(current: dict[str, float], baseline: dict[str, float], rules: dict[str, Rule]) -> list[Change]:
    """Metrics that moved beyond their rule's threshold in the *better* direction (the same relative
    threshold: plateau up by more than 25%, latency floor down by more than 50%). Not a failure, but
    the numbers no longer describe the baseline's cluster: a warning to rebaseline if intended."""
    return _moves(current, baseline, rules, better=True)


def environment_changes(current: dict[str, str], baseline: dict[str, str]) -> list[str]:
    return [
        f"{k}: {baseline.get(k)} → {current.get(k)}"
        for k in sorted(set(current) | set(baseline))
        if current.get(k) != baseline.get(k)
    ]


@dataclass
class Verdict:
    passed: bool  # no metric moved beyond its threshold in the worse direction
    recorded: bool  # this run became the baseline
    changes: list[Change]
    environment_changes: list[str]
    baseline: dict[str, Any] | None
    improvements: list[Change] = field(default_factory=list)  # beyond the threshold the better way: a warning

    @property
    def warning(self) -> bool:
        """Passed, but some metric improved beyond its threshold (rebaseline if intended)."""
        return self.passed and bool(self.improvements)

    def summary(self) -> str:
        if self.recorded:
            return "no baseline for this cluster shape yet: this run is now the baseline"
        if not self.passed and self.baseline is None:
            return "the rung failed, so this run was not recorded as a baseline (and there is none to compare with)"
        if self.passed and not self.improvements:
            return "within thresholds of the baseline" + (
                f" (environment changed: {'; '.join(self.environment_changes)})" if self.environment_changes else ""
            )
        out = "; ".join(c.message() for c in self.changes + self.improvements)
        if self.environment_changes:
            out += f". Environment changes since the baseline: {'; '.join(self.environment_changes)}"
        return out


class BaselineStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, rung: str, shape: str) -> Path:
        return self.root / f"{rung}-{shape}.json"

    def load(self, rung: str, shape: str) -> dict[str, Any] | None:
        p = self.path(rung, shape)
        return json.loads(p.read_text()) if p.exists() else None

    def save(self, rung: str, shape: str, metrics: dict[str, float], env: dict[str, str]) -> dict[str, Any]:
        self.root.mkdir(parents=True, exist_ok=True)
        record = {
            "rung": rung,
            "shape": shape,
            "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "metrics": metrics,
            "environment": env,
        }
        p = self.path(rung, shape)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(tmp, p)
        return record

    def append_history(
        self, rung: str, shape: str, metrics: dict[str, float], env: dict[str, str], verdict: Verdict
    ) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / f"{rung}-{shape}.history.jsonl").open("a") as f:
            f.write(
                json.dumps(
                    {
                        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "metrics": metrics,
                        "environment": env,
                        "passed": verdict.passed,
                        "changes": [c.message() for c in verdict.changes],
                        "improvements": [c.message() for c in verdict.improvements],
                    },
                    sort_keys=True,
                )
                + "\n"
            )

    def check(
        self,
        rung: str,
        shape: str,
        metrics: dict[str, float],
        env: dict[str, str],
        rules: dict[str, Rule],
        rebaseline: bool = False,
        record: bool = True,
    ) -> Verdict:
        """Compare with the stored baseline (recording this run when there is none, or when asked).

        ``record=False`` (the rung itself failed) never makes this run a baseline: with no baseline
        yet, the verdict fails with nothing to compare."""
        base = self.load(rung, shape)
        if not record and (base is None or rebaseline):
            verdict = Verdict(False, False, [], [], None)
        elif base is None or rebaseline:
            self.save(rung, shape, metrics, env)
            verdict = Verdict(True, True, [], [], None)
        else:
            changes = compare(metrics, base["metrics"], rules)
            verdict = Verdict(
                not changes,
                False,
                changes,
                environment_changes(env, base.get("environment", {})),
                base,
                improvements(metrics, base["metrics"], rules),
            )
        self.append_history(rung, shape, metrics, env, verdict)
        return verdict
