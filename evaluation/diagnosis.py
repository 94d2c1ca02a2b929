"""Why a candidate failed: a diagnosis beside the gate's verdict, each cause with its evidence and the recipe change
most likely to fix it. Plain logic on the evaluation's item results (no model, no Dagster).

Causes, checked in this order (thresholds below, each a named constant):

* **memorised**: the candidate scores ``MEMORISED_GAP`` (0.3) or more higher on a sample of its own training items
  than on the held-out task items, and at least ``LEARNED`` (0.5) on the training items. Fix: more distinct task
  prompts, fewer epochs, keep the best checkpoint by held-out loss (``training.selection``).
* **knew it, lost it** / **never knew**: the candidate fails the task (below ``LEARNED``, or below the task suite's
  score floor) with the right answer format on at least half of the items (``format_ok``: as many words as the
  reference, give or take a third). Did the student know the content before? The base's own free-form answers to
  the task items are scored leniently (the reference appears in the answer as a whole word: ``contains_answer``)
  and paired with the candidate's strict scores: when the paired interval of base-lenient minus candidate-strict
  excludes 0, the base knew what the candidate lost ("knew it, lost it": the fine-tune taught the format and broke
  the recall; fix: ``data.targets.content: base``, targets built from the student's own answers in the teacher's
  format, each after one space (``prefix_space``); the fix names the parts the recipe lacks). Otherwise the base
  never knew it ("never knew": a distillation carries a format, not facts the student lacks; fix: more examples per
  fact, or a student that knows them).
* **not learned**: below ``LEARNED`` on the held-out task items *and* on its training items, and the answer format
  is not there either (too few steps, too low a learning rate).
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

from evaluation.gate import StatsPolicy
from evaluation.scorers import contains_answer

MEMORISED_GAP = 0.3
LEARNED = 0.5
EMPTY_DRIFT = 0.05
LENGTH_DRIFT = 2.0
FORGOT_DROP = 0.05
CONFLICT_RATIO = 2.0
EXAMPLES = 3  # items shown as evidence of "knew it, lost it"
KEEP_KNOWLEDGE_FIX = (
    "keep what the student knows: set data.targets: {content: base, rule: known, prefix_space: true}, so the "
    "student trains only on the facts its own answers hold (the rows whose base answer names the prompt's "
    "reference, that reference as the target; rule: short_form where the prompts carry no references) instead of "
    "the teacher's answers, each written after one space (the token the base writes the word with inside a "
    "sentence), and train LoRA on the MLP too (student.lora.target_modules: gate_proj, up_proj, down_proj besides "
    'the attention) (docs/real-model.md, "Keeping what the student knows")'
)
KEEP_KNOWLEDGE_FIX_ON = (
    "the setting that keeps what the student knows is on already (data.targets content: base, rule: known and "
    "prefix_space, LoRA on the MLP): a larger replay share if general answers drift, more epochs while the kept "
    'checkpoint is the last one (docs/results.md, "Keeping what the student knows")'
)

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
    """One suite's item results per role (objects with ``item_id``, ``category``, ``output``, ``score``,
    ``reference``, ``prompt``); ``min_score``: the suite's score floor in the gate (None: none)."""

    name: str
    candidate: list
    base: list
    max_regression: float | None = None
    teacher: list | None = None
    min_score: float | None = None


@dataclass
class Context:
    """What the recipe had: replay or not, whether the teacher is the base, the replay share, conflicts found."""

    has_replay: bool = False
    teacher_is_base: bool = False
    replay_share: float | None = None
    conflicts: list[dict] = field(default_factory=list)
    keeps_knowledge: bool = False  # data.targets.content: base is on already
    # what the recipe lacks of the setting that keeps what the student knows (recipe_checks.keep_knowledge_changes;
    # None: not known, the whole setting is named)
    knowledge_changes: tuple[str, ...] | None = None
    stats: StatsPolicy = field(default_factory=StatsPolicy)  # the campaign's interval method for the paired checks


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
    else:
        causes += _task_failure(task, held, train, ctx)
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


def knowledge(task: SuiteItems, sp: StatsPolicy) -> dict | None:
    """Did the base know the task's content? Per item (paired by id): the base's own free-form answer scored
    leniently (the reference appears in it as a whole word, ``contains_answer``) against the candidate's strict
    score; the paired interval of base-lenient minus candidate-strict, the items the base knew and how many of
    those the candidate answers right, and a few the candidate lost (None: no paired item with a reference)."""
    from evaluation.stats import paired_difference

    base = {i.item_id: i for i in task.base}
    teacher = {i.item_id: i for i in task.teacher or []}
    pairs = [
        (base[c.item_id], c)
        for c in task.candidate
        if c.item_id in base and c.score is not None and (c.reference or base[c.item_id].reference)
    ]
    if not pairs:
        return None
    lenient = [contains_answer(b.output, b.reference or c.reference) for b, c in pairs]
    strict = [float(c.score) for _, c in pairs]
    iv = paired_difference(lenient, strict, sp.confidence, sp.method, sp.resamples, sp.seed)
    known = [k for k, x in enumerate(lenient) if x]
    lost = [k for k in known if strict[k] < 1.0]
    taught = [teacher[pairs[k][1].item_id] for k in lost if pairs[k][1].item_id in teacher]
    return {
        "items": len(pairs),
        "base_lenient": mean(lenient),
        "candidate_strict": mean(strict),
        "difference": iv.as_dict(),
        "knew": iv.defined and iv.lo > 0,
        "base_knew": len(known),
        "candidate_kept": len(known) - len(lost),
        "teacher_right_on_lost": sum(float(t.score or 0.0) >= 1.0 for t in taught) if taught else None,
        "teacher_scored_lost": len(taught),
        "examples": [
            {
                "prompt": pairs[k][1].prompt,
                "reference": pairs[k][1].reference or pairs[k][0].reference,
                "base": pairs[k][0].output,
                "candidate": pairs[k][1].output,
            }
            for k in lost[:EXAMPLES]
        ],
    }


def _task_failure(task: SuiteItems, held: float | None, train: float | None, ctx: Context) -> list[dict]:
    """Why the candidate fails the task when it did not memorise it: it knew the content and lost it, it never
    knew it, or it did not learn the answer format."""
    if held is None:
        return []
    floor = max(LEARNED, task.min_score or 0.0)
    if held >= floor:
        return []
    fmt = mean([float(format_ok(i.output, i.reference)) for i in task.candidate]) or 0.0
    where = f"{held:.0%} held-out" + (f", {train:.0%} on its training items" if train is not None else "")
    if fmt < 0.5:
        if held >= LEARNED or (train is not None and train >= LEARNED):
            return []
        return [
            {
                "cause": "not learned",
                "evidence": f"{task.name}: {where}; {fmt:.0%} of the answers have the reference's format",
                "fix": (
                    "too little training to learn the answer format: raise training.epochs (see the recipe checks: "
                    "optimizer steps) or the learning rate"
                ),
            }
        ]
    k = knowledge(task, ctx.stats)
    if k is None:
        return []
    d = k["difference"]
    interval = f"{d['estimate'] * 100:+.1f} pts [{d['lo'] * 100:+.1f}, {d['hi'] * 100:+.1f}]"
    scores = (
        f"{task.name}: the base's own answers contain the reference on {k['base_lenient']:.0%} of the "
        f"{k['items']} items (lenient), the candidate answers {k['candidate_strict']:.0%} right (strict); "
        f"base-lenient minus candidate-strict {interval}"
    )
    if k["knew"]:
        teacher = (
            f"; the teacher was right on {k['teacher_right_on_lost']} of the {k['teacher_scored_lost']} it lost"
            if k["teacher_scored_lost"]
            else ""
        )
        examples = "; ".join(
            f"{e['prompt']!r}: base {_clip(e['base'])!r}, candidate {_clip(e['candidate'])!r} "
            f"(reference {e['reference']!r})"
            for e in k["examples"]
        )
        return [
            {
                "cause": "knew it, lost it",
                "evidence": (
                    f"{scores}; of the {k['base_knew']} items the base knew it keeps {k['candidate_kept']}{teacher}; "
                    f"e.g. {examples}"
                ),
                "knowledge": k,
                "fix": _keep_knowledge_fix(ctx),
            }
        ]
    if k["base_lenient"] >= floor:  # the base knew enough to pass, and the loss is within the noise
        return []
    return [
        {
            "cause": "never knew",
            "evidence": f"{scores}: the base did not know the content either (below the task's {floor:.0%}); "
            f"{fmt:.0%} of the candidate's answers have the reference's format",
            "knowledge": k,
            "fix": "a distillation teaches the format, not facts the student lacks: more task examples per fact and "
            "more epochs (the facts must be memorised, and held-out facts will not follow), a student that "
            "knows the facts (a larger base), or a task limited to what the student knows",
        }
    ]


def _clip(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


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


def _keep_knowledge_fix(ctx: Context) -> str:
    """The "knew it, lost it" fix: the parts of the setting the recipe lacks, or what is left to try with it on."""
    if ctx.knowledge_changes is None:
        return KEEP_KNOWLEDGE_FIX_ON if ctx.keeps_knowledge else KEEP_KNOWLEDGE_FIX
    if not ctx.knowledge_changes:
        return KEEP_KNOWLEDGE_FIX_ON
    return (
        f"keep what the student knows: set {'; and '.join(ctx.knowledge_changes)} "
        '(docs/real-model.md, "Keeping what the student knows")'
    )


def campaign_diagnosis(spec, res: dict, train_sample_path: str | None, found: list | None = None) -> dict:
    """:func:`diagnose` on a campaign's evaluation results (``read_item_results`` of its answers): the primary
    suite as the task, the regression suites as guards, the candidate's scored training sample
    (``train_sample_path``, None when not answered) and the distillation set's task/replay format conflicts
    (``found``)."""
    from pathlib import Path

    from campaign_orchestrator.recipe_checks import (
        keep_knowledge_changes,
        keeps_knowledge,
        regression_suites,
        teacher_is_base,
    )
    from evaluation.suite import read_item_results

    ev = spec.evaluation
    cand, base, teacher = res.get("candidate", {}), res.get("base", {}), res.get("teacher", {})

    def items(name):
        gate = ev.gate_for(next(s for s in ev.suites if s.name == name))
        return SuiteItems(
            name,
            cand.get(name, []),
            base.get(name, []),
            gate.max_regression_vs_base,
            teacher.get(name),
            gate.min_score,
        )

    guards = [items(n) for n in regression_suites(spec) if n in cand]
    sample = None
    if train_sample_path and Path(train_sample_path).exists():
        sample = read_item_results(train_sample_path).get("candidate", {}).get("train_sample")
    rp, st = spec.data.replay, ev.statistics
    ctx = Context(
        has_replay=rp is not None,
        teacher_is_base=teacher_is_base(spec),
        replay_share=rp.share if rp is not None else None,
        conflicts=found or [],
        keeps_knowledge=keeps_knowledge(spec),
        knowledge_changes=tuple(keep_knowledge_changes(spec)),
        stats=StatsPolicy(st.interval, st.confidence, st.resamples, st.seed),
    )
    return diagnose(items(ev.suites[0].name), guards, sample, ctx)
