"""``data.targets.content: base``: training targets that keep what the student knows.

A teacher that answers in a new format (one lowercase word, a label, a JSON field) teaches two things at once: the
format, and its own content. Where the student already held the content in its own words, the format is all it
needs; where the teacher's answer says something the student does not hold (a fact it never knew, or one the
teacher got wrong), training on it teaches the format *and* overwrites the recall: the student answers in the new
format with the wrong content ("knew it, lost it" in ``evaluation/diagnosis.py``). Measured on
``campaigns/smollm2_facts.yaml``: docs/results.md, "Keeping what the student knows".

So each task row is checked against the student's base model's own free-form answer to the same prompt: the row
is kept when the teacher's answer appears in it as a whole word (``evaluation.scorers.contains_answer``, passed in
by the asset: this library sits below ``evaluation``), i.e. the
target is the student's own answer in the teacher's short form; otherwise it is dropped and counted (``disagree``).

Plain logic; the asset (``assets/distillation_set.py``) has the base answer the prompts (the local engine and the
generation cache, as ``data.replay`` does) through the ``answer`` function it passes in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

EXAMPLES = 5  # dropped rows shown in the summary


Contains = Callable[[str, str], float]  # (answer, short form) -> 1.0 when the short form is in the answer


def agree(rows: Sequence[dict], base_answers: dict[str, str], contains: Contains) -> tuple[list[dict], dict]:
    """``(kept, summary)``: the rows whose completion appears in the base's answer to the row's prompt by
    ``contains`` (``base_answers``: prompt -> answer); the summary counts the kept and the dropped (``disagree``;
    ``unanswered``: no base answer for the prompt) and shows a few dropped rows."""
    kept, dropped, unanswered = [], [], 0
    for r in rows:
        said = base_answers.get(r["prompt"])
        if said is None:
            unanswered += 1
        elif contains(said, r["completion"]) >= 1.0:
            kept.append(r)
        else:
            dropped.append((r, said))
    return kept, {
        "input": len(rows),
        "kept": len(kept),
        "disagree": len(dropped),
        "unanswered": unanswered,
        "kept_fraction": len(kept) / max(1, len(rows)),
        "examples": [
            {"prompt": r["prompt"], "teacher": r["completion"], "base": said} for r, said in dropped[:EXAMPLES]
        ],
    }


def base_targets(
    rows: list[dict],
    answer: Callable[[list[dict]], tuple[list[dict], list[dict], dict]],
    contains: Contains,
    log=None,
) -> tuple[list[dict], dict, list[dict]]:
    """``(kept rows, summary, cost lines)``: the filtered task rows checked against the base's own answers to their
    prompts (``answer(prompts)`` -> (generation rows, cost lines, generation stats dict): the asset's local engine
    and cache), each prompt asked once."""
    prompts = list({r["prompt"]: {"id": str(r["id"]), "prompt": r["prompt"]} for r in rows}.values())
    answered, lines, stats = answer(prompts)
    said = {g["prompt"]: g.get("completion") or "" for g in answered if not g.get("error")}
    kept, summary = agree(rows, said, contains)
    summary |= stats | {"usd": sum(x["usd"] for x in lines)}
    if log is not None:
        log(
            f"data.targets: content base: {summary['kept']} of {summary['input']} task rows kept (the teacher's answer "
            f"is in the base's own answer), {summary['disagree']} dropped"
        )
    return kept, summary, lines
