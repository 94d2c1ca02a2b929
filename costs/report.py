"""Cost per result: roll the stage manifests' cost lines up into the figures a team compares."""

from __future__ import annotations

from collections import defaultdict


def cost_per_result(stage_manifests: dict[str, dict], accepted_examples: int, teacher_tokens: int,
                    candidate_score: float | None, base_score: float | None) -> dict:
    """Totals by kind, $/M teacher tokens, $ per 1k accepted examples, $ per point gained.

    A "point" is one percentage point of the primary suite's score; when the candidate does not
    beat the base the figure is ``None`` ("not meaningful")."""
    by_kind: dict[str, float] = defaultdict(float)
    hours: dict[str, float] = defaultdict(float)
    for m in stage_manifests.values():
        for line in m.get("cost_lines", []):
            by_kind[line["kind"]] += line["usd"]
            if line["unit"] in ("gpu-hour", "host-hour"):
                hours[line["unit"]] += line["quantity"]
    total = sum(by_kind.values())
    gain_points = None if candidate_score is None or base_score is None else (candidate_score - base_score) * 100
    return {
        "total_usd": total,
        "teacher_usd": by_kind.get("teacher", 0.0),
        "training_usd": by_kind.get("training", 0.0),
        "evaluation_usd": by_kind.get("evaluation", 0.0),
        "teacher_tokens": teacher_tokens,
        "usd_per_million_teacher_tokens": by_kind.get("teacher", 0.0) / (teacher_tokens / 1e6) if teacher_tokens else None,
        "accepted_examples": accepted_examples,
        "usd_per_1k_accepted_examples": total / accepted_examples * 1000 if accepted_examples else None,
        "score_gain_points": gain_points,
        "usd_per_point_gained": total / gain_points if gain_points and gain_points > 0 else None,
        "gpu_hours": hours.get("gpu-hour", 0.0),
        "host_hours": hours.get("host-hour", 0.0),
    }
