"""``data.targets.content: base``: training targets that keep what the student knows.

A teacher that answers in a new format (one lowercase word, a label, a JSON field) teaches two things at once: the
format, and its own content. Where the student already held the content in its own words, the format is all it
needs; where the teacher's answer says something the student does not hold (a fact it never knew, or one the
teacher got wrong), training on it teaches the format *and* overwrites the recall: the student answers in the new
format with the wrong content ("knew it, lost it" in ``evaluation/diagnosis.py``). Measured on
``campaigns/smollm2_facts.yaml``: docs/results.md, "Keeping what the student knows".

So the student's base model answers every task prompt in its own words, and the target is built from that answer
in the teacher's short form. The teacher's short forms are the answers it gave across the task (its vocabulary:
"germany", "france", ...), normalized (``normalize``: lowercase, no punctuation or articles):

* ``rule: short_form`` (default): the target is the teacher's short form that the base's answer names (as whole
  words; the earliest one when it names several), written as the teacher writes it: "The city of Leuven is in the
  French region of France" gives ``france``, whatever the teacher answered for Leuven. Rows whose base answer names
  none of the teacher's short forms are dropped (``unnamed``).
* ``rule: short_form_or_reference``: the same, with the task's own answer set in the vocabulary too: the references
  of the training prompts (``reference`` in the prompt file) the teacher never gave, as the data writes them. A
  weak teacher's vocabulary misses answers the base knows ("argentina" when the teacher never said it): with the
  task's labels those rows keep the base's answer instead of being dropped. The target is still what the base
  names, never the row's own reference unless the base names it.
* ``rule: agree``: only the rows whose own teacher answer the base's answer names are kept; the others are dropped
  (``disagree``).
* ``rule: known``: only the rows whose base answer names the row's own reference (``reference`` in the prompt file,
  whole words: the diagnosis's lenient "knew it") are kept, with the reference as the data writes it as the target;
  the others are dropped (``unknown``). The task's labels set the format and the content, the base's answer decides
  which facts it already holds: a target is never a fact the student lacks (Gekhman et al. 2024, "Does Fine-Tuning
  LLMs on New Knowledge Encourage Hallucinations?": fine-tuning on facts the model did not know teaches it to answer
  wrongly on those it did), and never a weak teacher's non-answer ("Southeast Asia" for a city in China) or its
  spelling where the labels write another ("The Netherlands" for "Netherlands", which exact match scores wrong).

Plain logic; the asset (``assets/distillation_set.py``) has the base answer the prompts (the local engine and the
generation cache, as ``data.replay`` does) and passes the normalizer in (``evaluation.scorers.normalize_answer``:
this library sits below ``evaluation``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

EXAMPLES = 5  # changed and dropped rows shown in the summary
RULES = ("short_form", "short_form_or_reference", "agree", "known")

Normalize = Callable[[str], str]


def short_forms(rows: Sequence[dict], normalize: Normalize, references: Sequence[str] = ()) -> dict[str, str]:
    """The teacher's vocabulary: each normalized answer -> the way the teacher writes it most often; then the task's
    ``references`` the teacher never gave, as the data writes them."""
    seen: dict[str, Counter] = {}
    for r in rows:
        text = (r.get("completion") or "").strip()
        key = normalize(text)
        if key:
            seen.setdefault(key, Counter())[text] += 1
    forms = {k: c.most_common(1)[0][0] for k, c in seen.items()}
    for ref in references:
        key = normalize(ref or "")
        if key and key not in forms:
            forms[key] = ref.strip()
    return forms


def named(answer: str, forms: dict[str, str], normalize: Normalize) -> str | None:
    """The short form ``answer`` names (whole words; the earliest, then the longest), normalized; None if none."""
    text = f" {normalize(answer)} "
    best = None
    for key in forms:
        at = text.find(f" {key} ")
        if at >= 0 and (best is None or (at, -len(key)) < (best[0], -len(best[1]))):
            best = (at, key)
    return best[1] if best else None


def build(
    rows: Sequence[dict],
    base_answers: dict[str, str],
    normalize: Normalize,
    rule: str = "short_form",
    references: Sequence[str] = (),
    row_references: dict[str, str] | None = None,
) -> tuple[list[dict], dict]:
    """``(rows, summary)``: the task rows with the targets built from the base's answers (``base_answers``: prompt
    -> answer) under ``rule``; the summary counts the kept rows, how many targets differ from the teacher's own
    answer (``changed``), the dropped (``unnamed`` / ``disagree`` / ``unknown``; ``unanswered``: no base answer) and
    shows a few. ``row_references`` (prompt -> reference): each row's own label, for ``rule: known``."""
    if rule not in RULES:
        raise ValueError(f"data.targets.rule must be one of {RULES}, got {rule!r}")
    if rule == "known":
        refs = row_references or {}

        def choose(r: dict, said: str) -> tuple[bool, str | None]:
            ref = (refs.get(r["prompt"]) or "").strip()
            key = normalize(ref)
            if not key or f" {key} " not in f" {normalize(said)} ":
                return False, None
            return True, None if (r.get("completion") or "").strip() == ref else ref

        return _summarised(rule, rows, base_answers, choose, "unknown")
    forms = short_forms(rows, normalize, references if rule == "short_form_or_reference" else ())

    def choose(r: dict, said: str) -> tuple[bool, str | None]:
        own = normalize(r.get("completion") or "")
        if rule != "agree":
            key = named(said, forms, normalize)
        else:
            key = own if own and f" {own} " in f" {normalize(said)} " else None
        if key is None:
            return False, None
        return True, None if key == own else forms[key]

    kept, summary = _summarised(rule, rows, base_answers, choose, "disagree" if rule == "agree" else "unnamed")
    return kept, summary | {"short_forms": len(forms)}


def _summarised(rule: str, rows: Sequence[dict], base_answers: dict[str, str], choose, dropped_as: str):
    """``(rows, summary)``: each answered row kept as it is, kept with a new target, or dropped, as ``choose(row,
    base answer)`` -> ``(keep, new target or None)`` says; the summary counts each (``dropped_as``: the dropped rows'
    name) and shows a few."""
    kept, changed, dropped, unanswered = [], [], [], 0
    for r in rows:
        said = base_answers.get(r["prompt"])
        if said is None:
            unanswered += 1
            continue
        keep, target = choose(r, said)
        if not keep:
            dropped.append((r, said))
        elif target is None:
            kept.append(r)
        else:
            kept.append(dict(r, completion=target))
            changed.append((r, said, target))
    return kept, {
        "rule": rule,
        "input": len(rows),
        "kept": len(kept),
        "changed": len(changed),
        dropped_as: len(dropped),
        "unanswered": unanswered,
        "kept_fraction": len(kept) / max(1, len(rows)),
        "examples_changed": [
            {"prompt": r["prompt"], "teacher": r["completion"], "base": said, "target": t}
            for r, said, t in changed[:EXAMPLES]
        ],
        "examples_dropped": [
            {"prompt": r["prompt"], "teacher": r["completion"], "base": said} for r, said in dropped[:EXAMPLES]
        ],
    }


def base_targets(
    rows: list[dict],
    answer: Callable[[list[dict]], tuple[list[dict], list[dict], dict]],
    normalize: Normalize,
    rule: str = "short_form",
    log=None,
    references: Sequence[str] = (),
    row_references: dict[str, str] | None = None,
) -> tuple[list[dict], dict, list[dict]]:
    """``(rows, summary, cost lines)``: the filtered task rows with targets built from the base's own answers to
    their prompts (``answer(prompts)`` -> (generation rows, cost lines, generation stats): the asset's local engine
    and cache), each prompt asked once; ``references``: the task's answer set (``rule: short_form_or_reference``);
    ``row_references``: prompt -> its reference (``rule: known``)."""
    prompts = list({r["prompt"]: {"id": str(r["id"]), "prompt": r["prompt"]} for r in rows}.values())
    answered, lines, stats = answer(prompts)
    said = {g["prompt"]: g.get("completion") or "" for g in answered if not g.get("error")}
    kept, summary = build(rows, said, normalize, rule, references, row_references)
    summary |= stats | {"usd": sum(x["usd"] for x in lines)}
    if log is not None:
        log(
            f"data.targets: content base ({rule}): {summary['kept']} of {summary['input']} task rows kept, "
            f"{summary['changed']} with the base's answer instead of the teacher's"
        )
    return kept, summary, lines
