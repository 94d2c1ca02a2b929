"""Recipe checks before the money is spent: does this training recipe have a chance to learn the task and keep
the rest? Run by ``campaign plan`` (on the plan's data facts) and at the start of ``student_adapter`` (on the
tokenized dataset it is about to train on). Each failing check names the number, why it matters and what to
change; none blocks a run (a recipe can be right for reasons these rules do not see).

The rules (the measurements behind each threshold: docs/real-model.md, "Recipe checks"):

* ``optimizer_steps`` >= ``MIN_STEPS``: fewer steps than the shipped SmolLM2 campaigns needed to learn the
  one-word answer format.
* ``examples_per_step`` >= ``MIN_EXAMPLES_PER_STEP``: fewer makes each step's gradient one or two items'.
* ``task_epochs`` <= ``MAX_TASK_EPOCHS``: more passes over the task items is a recipe for memorising them.
* ``replay``: a campaign that guards general ability with a regression suite (a suite besides the first, from its
  own file, with no score floor) and whose teacher is not the student's base needs ``data.replay`` (without it
  the student forgets general ability); ``share`` >= ``MIN_REPLAY_SHARE``.
* ``learning_rate``: ``learning_rate x lora.alpha / lora.r`` (the update scale LoRA applies) within
  [``MIN_LORA_LR_SCALE``, ``MAX_LORA_LR_SCALE``]: the range the shipped campaigns train well in, with a tenfold
  margin each way; 0 trains nothing.
* ``heldout_size``: every suite's items >= the gate's ``min_items`` (fewer is INCONCLUSIVE whatever is trained).
* ``keep_knowledge``: the campaign's last evaluation diagnosed "knew it, lost it" (``evaluation/diagnosis.py``: the
  base's own answers held the task's content, the candidate lost it) and the recipe lacks part of the setting that
  kept it best on the facts task: targets from the base's own answers (``data.targets.content: base``, rule
  ``known``: only the facts the base's answers hold, in the task's labels), each written after one space
  (``data.targets.prefix_space``) and LoRA on the MLP too (the measurements: docs/results.md, "Keeping what the
  student knows").
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

MIN_STEPS = 30
MIN_EXAMPLES_PER_STEP = 4
MAX_TASK_EPOCHS = 10.0
MIN_REPLAY_SHARE = 0.2
MIN_LORA_LR_SCALE = 1e-5
MAX_LORA_LR_SCALE = 5e-2


@dataclass
class RecipeFacts:
    """What the checks need: task and replay examples, rows after packing, suite sizes."""

    task_examples: int
    replay_examples: int
    rows: float  # training rows after packing (several examples per row)
    tokens_per_row: float
    suite_items: dict[str, int]


@dataclass
class Finding:
    check: str
    value: float | int | str
    message: str

    def as_dict(self) -> dict:
        return asdict(self)


def steps_of(spec, facts: RecipeFacts) -> int:
    tr = spec.training
    if tr.max_steps is not None:
        return tr.max_steps
    return max(1, math.ceil(tr.epochs * facts.rows / tr.effective_batch))


def regression_suites(spec) -> list[str]:
    """Suites that guard general ability: not the primary, read from their own file, with no score floor."""
    ev = spec.evaluation
    return [s.name for s in ev.suites[1:] if s.source != "heldout" and ev.gate_for(s).min_score is None]


def teacher_is_base(spec) -> bool:
    """The teacher is the student's base (several teachers: every one is)."""
    s = spec.student
    return all(t.backend != "openai" and t.model == s.base_model and t.revision == s.revision for t in spec.teachers)


# the MLP's linear layers as LoRA targets name them (Llama/Qwen/SmolLM2; OPT/Phi; GPT-2; Mixtral's experts)
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "c_fc", "w1", "w2", "w3")


def keeps_knowledge(spec) -> bool:
    """The training targets carry the student's own answers (``data.targets.content: base``)."""
    t = getattr(spec.data, "targets", None)
    return t is not None and t.content == "base"


def lora_on_mlp(spec) -> bool:
    """LoRA adapts the MLP too (where models keep most of what they know), not the attention alone."""
    return any(m.rsplit(".", 1)[-1] in MLP_MODULES for m in spec.student.lora.target_modules)


def keep_knowledge_changes(spec) -> list[str]:
    """What the recipe lacks of the setting measured to keep what the student knows (docs/results.md, "Keeping what
    the student knows"): targets from the base's own answers (rule ``known``), written after one space, LoRA on the
    MLP too."""
    out = []
    t = getattr(spec.data, "targets", None)
    if not keeps_knowledge(spec):
        out.append(
            "data.targets: {content: base, rule: known} (train only on the facts the student holds: the rows whose "
            "base answer names the prompt's reference, that reference as the target; rule: short_form where the "
            "prompts carry no references)"
        )
    elif t.rule != "known":
        out.append(
            "data.targets.rule: known where the training prompts carry references (only the rows whose base answer "
            "names the prompt's reference, that reference as the target: no fact the student lacks, no teacher "
            "non-answer or spelling the labels do not use)"
        )
    if t is None or not t.prefix_space:
        out.append(
            "data.targets.prefix_space: true (each target written after one space, ' Poland': the token the base "
            "reads and writes the word with inside a sentence, where its facts are)"
        )
    if not lora_on_mlp(spec):
        out.append("student.lora.target_modules with the MLP too (gate_proj, up_proj, down_proj: the default)")
    return out


def latest_diagnosis(campaign_dir: str | Path) -> list[dict]:
    """The causes of the campaign's latest judged evaluation (``<campaign dir>/evaluation/LATEST.json``; empty when
    it was never evaluated)."""
    p = Path(campaign_dir) / "evaluation" / "LATEST.json"
    return list(json.loads(p.read_text()).get("diagnosis") or []) if p.exists() else []


def check_recipe(spec, facts: RecipeFacts, diagnosis: list[dict] | None = None) -> list[Finding]:
    """Every check that fails, each with its number, why it matters and what to change (empty: none fails);
    ``diagnosis``: the causes of the campaign's last evaluation (:func:`latest_diagnosis`), for the checks that
    learn from it."""
    tr, out = spec.training, []
    examples = facts.task_examples + facts.replay_examples
    per_row = examples / max(1.0, facts.rows)
    steps = steps_of(spec, facts)
    per_step = tr.effective_batch * per_row
    if steps < MIN_STEPS:
        need = math.ceil(MIN_STEPS * tr.effective_batch / max(1.0, facts.rows))
        out.append(
            Finding(
                "optimizer_steps",
                steps,
                (
                    f"{steps} optimizer steps ({examples} examples, ~{per_row:.1f} per packed row, effective batch "
                    f"{tr.effective_batch} rows): too few to learn a new answer format (fewer than {MIN_STEPS}); raise "
                    f"training.epochs to >= {need}"
                    + (" (or max_steps)" if tr.max_steps else "")
                    + " or lower the effective batch (micro_batch_size x gradient_accumulation_steps)"
                ),
            )
        )
    if per_step < MIN_EXAMPLES_PER_STEP:
        out.append(
            Finding(
                "examples_per_step",
                round(per_step, 2),
                (
                    f"~{per_step:.1f} examples ({per_step * facts.tokens_per_row / max(1.0, per_row):.0f} tokens) per "
                    f"optimizer step: each step's gradient is one or two items' (fewer than {MIN_EXAMPLES_PER_STEP}); "
                    "raise micro_batch_size or gradient_accumulation_steps"
                ),
            )
        )
    epochs = steps * per_step / max(1, examples)  # the mix is shuffled: task and replay pass equally often
    if epochs > MAX_TASK_EPOCHS:
        out.append(
            Finding(
                "task_epochs",
                round(epochs, 1),
                (
                    f"{epochs:.1f} passes over the {facts.task_examples} task examples: the student memorises its "
                    f"training items instead of learning the task (more than {MAX_TASK_EPOCHS:g}); add task prompts, "
                    "or lower training.epochs / max_steps and keep the best checkpoint (training.selection)"
                ),
            )
        )
    guards = regression_suites(spec)
    rp = getattr(spec.data, "replay", None)
    if guards and rp is None and not teacher_is_base(spec):
        out.append(
            Finding(
                "replay",
                0.0,
                (
                    f"no replay, and the gate guards general ability ({', '.join(guards)}) while the teacher "
                    f"({spec.teacher.model}) is not the student's base: trained on the task alone the student forgets "
                    "what it could do; add data.replay (general prompts answered by the base student, share 0.3-0.5)"
                ),
            )
        )
    elif rp is not None and examples and facts.replay_examples / examples < MIN_REPLAY_SHARE:
        share = facts.replay_examples / examples
        out.append(
            Finding(
                "replay",
                round(share, 3),
                (
                    f"replay is {share:.0%} of the training mix (fewer than {MIN_REPLAY_SHARE:.0%}): too little to "
                    f"keep the base's behaviour; raise data.replay.share or add prompts to {rp.source}"
                ),
            )
        )
    lo = spec.student.lora
    scale = tr.learning_rate * lo.alpha / lo.r
    if scale < MIN_LORA_LR_SCALE or scale > MAX_LORA_LR_SCALE:
        low = scale < MIN_LORA_LR_SCALE
        out.append(
            Finding(
                "learning_rate",
                tr.learning_rate,
                (
                    f"learning_rate {tr.learning_rate:g} x lora.alpha/r ({lo.alpha:g}/{lo.r}) = {scale:.2g}: "
                    + (
                        f"below {MIN_LORA_LR_SCALE:g}, the adapter barely moves (0 trains nothing); raise learning_rate"
                        if low
                        else f"above {MAX_LORA_LR_SCALE:g}, LoRA updates this large overwrite what the base knew; "
                        f"lower learning_rate to <= {MAX_LORA_LR_SCALE * lo.r / lo.alpha:.2g}"
                    )
                ),
            )
        )
    lost = next((c for c in diagnosis or [] if c.get("cause") == "knew it, lost it"), None)
    missing = keep_knowledge_changes(spec) if lost is not None else []
    if missing:
        k = lost.get("knowledge") or {}
        out.append(
            Finding(
                "keep_knowledge",
                round(float(k.get("base_lenient") or 0.0), 3),
                (
                    f"the last evaluation found the student knew the task's content and lost it: the base's own "
                    f"answers held {k.get('base_lenient', 0):.0%} of it (lenient), the candidate answered "
                    f"{k.get('candidate_strict', 0):.0%} (strict): the student learned the format and lost the "
                    f'recall. Set {"; and ".join(missing)} (docs/real-model.md, "Keeping what the student knows")'
                ),
            )
        )
    ev = spec.evaluation
    for s in ev.suites:
        n, need = facts.suite_items.get(s.name), ev.gate_for(s).min_items
        if n is not None and n < need:
            out.append(
                Finding(
                    "heldout_size",
                    n,
                    (
                        f"suite {s.name!r} has {n} items, fewer than the gate's min_items {need}: the gate can only "
                        "say INCONCLUSIVE; "
                        + (
                            "raise data.heldout.fraction or max_items"
                            if s.source == "heldout"
                            else f"add items to {s.source}"
                        )
                        + " or lower evaluation.gate.min_items"
                    ),
                )
            )
    return out


def facts_from_plan(spec, data, replay_available: int | None = None) -> RecipeFacts:
    """The facts ``campaign plan`` knows (its ``DataFacts``, ``costs.plan.facts``): prompt counts and mean student
    tokens; every teacher answer accepted, ``cost.planner.completion_fill`` of ``max_new_tokens`` long; replay at
    its share."""
    t, tr = spec.teacher, spec.training
    task = data.train_prompts * t.sampling.n
    new_tokens = t.sampling.max_new_tokens * spec.cost.planner.completion_fill
    example = min(tr.max_seq_len, data.prompt_tokens_student + new_tokens + 1)
    rp = getattr(spec.data, "replay", None)
    replay = 0
    if rp is not None:
        from campaign_orchestrator.dataset.replay import replay_count

        replay = replay_count(task, rp.share, replay_available if replay_available is not None else task)
        example = min(tr.max_seq_len, (task * example + replay * (example + rp.max_new_tokens * 0.5)) / (task + replay))
    n = task + replay
    packed = spec.dataset.packing and example < tr.max_seq_len * 0.9
    rows = max(1.0, math.ceil(n * example / (tr.max_seq_len * 0.9))) if packed else float(n)
    return RecipeFacts(
        task, replay, rows, tr.max_seq_len * 0.9 if packed else example, {k: int(v[0]) for k, v in data.suites.items()}
    )


def facts_from_dataset(spec, manifest: dict, replay_examples: int = 0) -> RecipeFacts:
    """The facts at the start of ``student_adapter``: the tokenized dataset's train split (examples, rows, tokens);
    suite sizes are the plan's business (not known here: empty)."""
    t = manifest["splits"]["train"]
    rows = max(1, int(t["rows"]))
    return RecipeFacts(
        int(t["examples"]) - replay_examples,
        replay_examples,
        float(rows),
        float(manifest.get("total_tokens", 0)) / rows,
        {},
    )


def render(findings: list[Finding]) -> str:
    if not findings:
        return "recipe checks: all pass"
    return (
        "recipe checks: "
        + str(len(findings))
        + " to look at\n"
        + "\n".join(f"  WARN  {f.check}: {f.message}" for f in findings)
    )
