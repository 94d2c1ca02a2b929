"""What a budget guard or a Ray shard is priced with, as callables the stages hand down (``stages/pricing.py``):
closures over :func:`campaign_orchestrator.costs.catalog.stage_bill` defined here, beside the code that calls them,
so pricing a guard's or a shard's usage never calls back up into the stage layer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from campaign_orchestrator.costs.catalog import Catalog, bill_at, stage_bill


def teacher_meter(spec, catalog: Catalog) -> Callable:
    """The teacher guard's lines for the usage its new generations reported: ``stage_bill``, the ledger's own
    pricing (an unpriced teacher accrues nothing: the spec refuses a budget over it)."""
    return lambda u: (
        stage_bill(
            spec,
            catalog,
            "teacher_generations",
            {"seconds": u.seconds, "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens},
        )["lines"]
        or []
    )


def on_policy_meter(spec, catalog: Catalog) -> Callable:
    """The on-policy guard's lines for the teacher prefills charged so far (``stage_bill`` of
    ``on_policy_scoring``, as the ledger prices them)."""

    def lines(u) -> list[dict]:
        usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}
        return stage_bill(spec, catalog, "on_policy_scoring", usage)["lines"] or []

    return lines


def timed_lines(spec, stage: str, catalog: Catalog, usage: dict) -> Callable:
    """Cost lines of ``seconds`` of work for a timed stage (what the guard accrues; the teacher is metered)."""
    return lambda seconds, items: stage_bill(spec, catalog, stage, usage | {"seconds": seconds})["lines"]


def usage_lines(spec, catalog_path: Path, stage: str) -> Callable:
    """``price(usage) -> lines`` of ``stage`` (a Ray shard's usage, priced as the ledger prices it; None unpriced)."""
    return lambda usage: bill_at(spec, catalog_path, stage, usage)["lines"]


def plus_lines(line_fn: Callable, extra: list[dict]) -> Callable:
    """A timed guard's ``line_fn`` that also accrues the lines in ``extra`` (a list the stage appends to as it pays:
    evaluation's teacher answers)."""
    return lambda seconds, items: line_fn(seconds, items) + extra
