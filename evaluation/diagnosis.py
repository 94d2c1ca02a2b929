"""Why a candidate failed: a diagnosis beside the gate's verdict, each cause with its evidence and the recipe change
most likely to fix it. Plain logic on the evaluation's item results (no model, no Dagster).

Causes, checked in this order (thresholds below, each a named constant):

* **memorised**: the candidate scores ``MEMORISED_GAP`` (0.3) or more higher on a sample of its own training items
  than on the held-out task items, and at least ``LEARNED`` (0.5) on the training items. Fix: more distinct task
  prompts, fewer epochs, keep the best checkpoint by held-out loss (``training.selection``).
* **not learned**: below ``LEARNED`` on the held-out task items *and* on its training items. With the right answer
  format on at least half of the items (``format_ok``: as many words as the reference, give or take a third) it is
  "the right format, the wrong content" (the knowledge did not come with the format: more task data per fact, more
  epochs, or a student that knows the facts); otherwise nothing was learned (too few steps, too low a learning rate).
* **format drift**: the candidate's empty outputs exceed the base's by ``EMPTY_DRIFT`` (5 points), or its median
  answer length on a guard suite moved beyond ``LENGTH_DRIFT`` (x2 or /2) of the base's. Fix: replay, fewer steps or
  a lower learning rate, the end-of-turn token in the training rows.
* **forgot**: a regression-guard suite's score fell more than its allowed regression (``max_regression_vs_base``,
  else ``FORGOT_DROP``) below the base's, listed by category (largest drop first). Fix: ``data.replay`` when there is
  none (named "missing replay"), a larger replay share when there is, else fewer epochs or a lower learning rate.
* **conflicting data**: task and replay prompts of the same shape (their first two words) whose answers have
  different formats (median word counts differ by a factor of ``CONFLICT_RATIO``); :func:`conflicts` finds them on the
  distillation set. Fix: drop or rephrase those replay prompts, or phrase the task its own way.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

MEMORISED_GAP = 0.3
LEARNED = 0.5
EMPTY_DRIFT = 0.05
LENGTH_DRIFT = 2.0
FORGOT_DROP = 0.05
CONFLICT_RATIO = 2.0

_WORD = re.compile(r"\w+")


def words(text: str | None) -> int:
    return len(_WORD.findall(text or ""))


def format_ok(output: str, reference: str | None) -> bool:
    """The answer has the reference's shape: as many words, give or take a third (at least one)."""
    if reference is None:
        return False
    n = words(reference)
    return abs(words(output) - n) <= max(1, round(n / 3)) and bool(output.strip())


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


@dataclass
class SuiteItems:
    """One suite's item results per role (objects with ``category``, ``output``, ``score``, ``reference``)."""

    name: str
    candidate: list
    base: list
    max_regression: float | None = None


@dataclass
class Context:
    """What the recipe had: replay or not, whether the teacher is the base, the replay share, conflicts found."""

    has_replay: bool = False
    teacher_is_base: bool = False
    replay_share: float | None = None
    conflicts: list[dict] = field(default_factory=list)


def _score(items) -> float | None:
    return mean([float(i.score) for i in items if i.score is not None])


def diagnose(task: SuiteItems, guards: Sequence[SuiteItems], train_sample: Sequence | None, ctx: Context) -> dict:
    """``{"causes": [{"cause", "evidence", "fix"}], "markdown"}``; ``train_sample``: the candidate's results on a sample
    of its training task items (None: not scored, the memorisation check is skipped)."""
    causes = []
    held = _score(task.candidate)
    train = _score(train_sample) if train_sample else None
    if held is not None and train is not None and train >= LEARNED and train - held >= MEMORISED_GAP:
        causes.append(
            {
                "cause": "memorised",
                "evidence": (
                    f"{train:.0%} on {len(train_sample)} of its training items against {held:.0%} on the held-out "
                    f"{task.name} items"
                ),
                "fix": "more distinct task prompts, fewer epochs, and keep the best checkpoint by "
                "held-out loss (training.selection.rule: best_heldout_loss)",
            }
        )
    elif held is not None and held < LEARNED and (train is None or train < LEARNED):
        fmt = mean([float(format_ok(i.output, i.reference)) for i in task.candidate])
        where = f"{held:.0%} held-out" + (f", {train:.0%} on its training items" if train is not None else "")
        if fmt is not None and fmt >= 0.5:
            causes.append(
                {
                    "cause": "not learned: the right format, the wrong content",
                    "evidence": (f"{task.name}: {where}; {fmt:.0%} of the answers have the reference's format"),
                    "fix": "the format came without the knowledge: more task examples per fact, more epochs, or a "
                    "student that already knows the facts",
                }
            )
        else:
            causes.append(
                {
                    "cause": "not learned",
                    "evidence": f"{task.name}: {where}; {(fmt or 0):.0%} of the answers have the reference's format",
                    "fix": (
                        "too little training to learn the answer format: raise training.epochs (see the recipe checks: "
                        "optimizer steps) or the learning rate"
                    ),
                }
            )
    for s in [task, *guards]:
        ce = mean([float(not i.output.strip()) for i in s.candidate]) or 0.0
        be = mean([float(not i.output.strip()) for i in s.base]) or 0.0
        if ce - be >= EMPTY_DRIFT:
            causes.append(
                {
                    "cause": "format drift",
                    "evidence": f"{s.name}: {ce:.0%} empty answers against the base's {be:.0%}",
                    "fix": _drift_fix(ctx),
                }
            )
    for s in guards:
        cl = statistics.median([words(i.output) for i in s.candidate]) if s.candidate else 0
        bl = statistics.median([words(i.output) for i in s.base]) if s.base else 0
        if bl and (cl * LENGTH_DRIFT < bl or cl > bl * LENGTH_DRIFT):
            causes.append(
                {
                    "cause": "format drift",
                    "evidence": f"{s.name}: median answer {cl:g} words against the base's {bl:g}",
                    "fix": _drift_fix(ctx),
                }
            )
    for s in guards:
        c, b = _score(s.candidate), _score(s.base)
        allowed = s.max_regression if s.max_regression is not None else FORGOT_DROP
        if c is None or b is None or b - c <= allowed:
            continue
        by_cat = _category_drops(s)
        cats = ", ".join(f"{k} {v:+.0%}" for k, v in by_cat[:6] if v < 0)
        missing = not ctx.has_replay and not ctx.teacher_is_base
        causes.append(
            {
                "cause": "forgot" + (" (missing replay)" if missing else ""),
                "evidence": (
                    f"{s.name}: {c:.0%} against the base's {b:.0%} ({c - b:+.0%}, allowed -{allowed:.0%}); by "
                    f"category: {cats or 'spread evenly'}"
                ),
                "by_category": dict(by_cat),
                "fix": (
                    "add data.replay: general prompts answered by the base student (answered_by: base, share "
                    "0.3-0.5), so the student rehearses what it could do"
                    if missing
                    else f"raise data.replay.share (now {ctx.replay_share:.0%})"
                    if ctx.has_replay and ctx.replay_share is not None and ctx.replay_share < 0.5
                    else "fewer epochs or a lower learning rate, and keep the best checkpoint (training.selection)"
                ),
            }
        )
    for c in ctx.conflicts:
        causes.append(
            {
                "cause": "conflicting data",
                "evidence": (
                    f"prompts starting {c['shape']!r}: task answers ~{c['task_words']:g} words, replay answers "
                    f"~{c['replay_words']:g} words ({c['task_examples']} task, {c['replay_examples']} replay examples)"
                ),
                "fix": "drop or rephrase the replay prompts of that shape, or phrase the task its own way",
            }
        )
    return {"causes": causes, "markdown": markdown(causes)}


def _drift_fix(ctx: Context) -> str:
    return (
        "add data.replay so the student keeps its answer style elsewhere"
        if not ctx.has_replay
        else "fewer epochs or a lower learning rate; check that training rows end with the end-of-turn token"
    )


def _category_drops(s: SuiteItems) -> list[tuple[str, float]]:
    by: dict[str, list[list[float]]] = defaultdict(lambda: [[], []])
    for i in s.candidate:
        by[i.category or "-"][0].append(float(i.score or 0.0))
    for i in s.base:
        by[i.category or "-"][1].append(float(i.score or 0.0))
    drops = [(k, (mean(c) or 0.0) - (mean(b) or 0.0)) for k, (c, b) in by.items() if c and b]
    return sorted(drops, key=lambda kv: kv[1])


def shape(prompt: str) -> str:
    return " ".join(w.lower() for w in _WORD.findall(prompt)[:2])


def conflicts(task: Sequence[tuple[str, str]], replay: Sequence[tuple[str, str]], min_examples: int = 3) -> list[dict]:
    """Prompt shapes (first two words) present in both the task and the replay rows (``(prompt, completion)``) whose
    answers' median word counts differ by ``CONFLICT_RATIO`` or more (at least ``min_examples`` on each side)."""

    def by_shape(rows):
        out: dict[str, list[int]] = defaultdict(list)
        for p, c in rows:
            out[shape(p)].append(max(1, words(c)))
        return out

    t, r = by_shape(task), by_shape(replay)
    found = []
    for k in sorted(set(t) & set(r)):
        if len(t[k]) < min_examples or len(r[k]) < min_examples:
            continue
        tw, rw = statistics.median(t[k]), statistics.median(r[k])
        if max(tw, rw) >= CONFLICT_RATIO * min(tw, rw):
            found.append(
                {
                    "shape": k,
                    "task_words": tw,
                    "replay_words": rw,
                    "task_examples": len(t[k]),
                    "replay_examples": len(r[k]),
                }
            )
    return found


def markdown(causes: list[dict]) -> str:
    if not causes:
        return (
            "## Diagnosis\n\nNo failure pattern found (memorised, not learned, format drift, forgot, conflicting data)."
        )
    lines = ["## Diagnosis", ""]
    for c in causes:
        lines.append(f"- **{c['cause']}**: {c['evidence']}. *Fix:* {c['fix']}.")
    return "\n".join(lines)


def campaign_diagnosis(spec, res: dict, train_sample_path: str | None, found: list | None = None) -> dict:
    """:func:`diagnose` on a campaign's evaluation results (``read_item_results`` of its answers): the primary
    suite as the task, the regression suites as guards, the candidate's scored training sample
    (``train_sample_path``, None when not answered) and the distillation set's task/replay format conflicts
    (``found``)."""
    from pathlib import Path

    from campaign_orchestrator.recipe_checks import regression_suites, teacher_is_base
    from evaluation.suite import read_item_results

    ev = spec.evaluation
    cand, base = res.get("candidate", {}), res.get("base", {})

    def items(name):
        return SuiteItems(
            name,
            cand.get(name, []),
            base.get(name, []),
            ev.gate_for(next(s for s in ev.suites if s.name == name)).max_regression_vs_base,
        )

    guards = [items(n) for n in regression_suites(spec) if n in cand]
    sample = None
    if train_sample_path and Path(train_sample_path).exists():
        sample = read_item_results(train_sample_path).get("candidate", {}).get("train_sample")
    rp = spec.data.replay
    ctx = Context(
        has_replay=rp is not None,
        teacher_is_base=teacher_is_base(spec),
        replay_share=rp.share if rp is not None else None,
        conflicts=found or [],
    )
    return diagnose(items(ev.suites[0].name), guards, sample, ctx)
