"""The ``cost:`` and ``schedule:`` sections: the pricing catalog, overrides, budget, planner, cron."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from campaigns.spec.common import Cron, _Strict


class PriceOverride(_Strict):
    """A campaign's own price for a catalog entry (a negotiated contract, a reserved instance)."""

    usd: float | None = Field(None, ge=0, description="On-demand USD per hour (hourly entries).")
    spot_usd: float | None = Field(None, ge=0, description="Spot USD per hour (hourly entries).")
    input_usd: float | None = Field(None, ge=0, description="USD per million input tokens (API entries).")
    output_usd: float | None = Field(None, ge=0, description="USD per million output tokens (API entries).")
    batch_discount: float | None = Field(
        None, ge=0, lt=1, description="Fraction off with a batch API (0.5 = half price)."
    )
    source: str | None = Field(None, description="Where this price comes from (shown in the ledger and reports).")


class PlannerSpec(_Strict):
    """Assumptions of `campaign plan` and of the budget checks made before each stage. Hardware
    figures (peak FLOP/s, bandwidth, overheads) come from the pricing catalog's `perf` block."""

    mfu: float = Field(0.35, gt=0, le=1, description="Share of the device's peak FLOP/s training reaches.")
    generation_mfu: float = Field(0.5, gt=0, le=1, description="Share of peak FLOP/s prefill reaches.")
    completion_fill: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Expected completion length as a fraction of max_new_tokens (1.0 plans for the longest answers).",
    )
    memory_headroom: float = Field(0.9, gt=0, le=1, description="Usable fraction of device memory when judging fit.")


class CostSpec(_Strict):
    """Prices, budgets and planning assumptions of a campaign."""

    catalog: str | None = Field(
        None,
        description="Pricing catalog file (dated entries with sources); default: the catalog shipped with the "
        "project (campaigns/pricing/catalog.yaml).",
    )
    catalog_version: str | None = Field(
        None, description="Pin the catalog `version` this campaign was planned with; a different version is an error."
    )
    overrides: dict[str, float | PriceOverride] = Field(
        default_factory=dict,
        description="Price overrides by catalog key: a number (USD per the entry's unit) or a mapping of price fields.",
    )
    pricing_tier: Literal["on_demand", "spot"] = Field(
        "on_demand", description="Which hourly price hardware is billed at."
    )
    teacher_batch_api: bool = Field(
        False, description="An API teacher is billed at its batch price (catalog batch_discount)."
    )
    budget_usd: float | None = Field(
        None, gt=0, description="Stop spending beyond this many dollars (spend read from the cost ledger)."
    )
    budget_scope: Literal["campaign", "run"] = Field(
        "campaign", description="campaign: budgets cover every run of the campaign; run: each run on its own."
    )
    stage_budgets_usd: dict[Literal["teacher_generations", "student_adapter", "evaluation"], float] = Field(
        default_factory=dict, description="Optional per-stage budgets in USD, e.g. {teacher_generations: 50}."
    )
    check_estimates: bool = Field(
        True, description="Before a stage starts, refuse it when the planner's estimate exceeds the budget left."
    )
    planner: PlannerSpec = PlannerSpec()

    @field_validator("stage_budgets_usd")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: x for k, x in v.items() if x <= 0}
        if bad:
            raise ValueError(f"stage budgets must be > 0 USD, got {bad}")
        return v

    def price_overrides(self) -> dict[str, float | dict]:
        """Overrides in the pricing catalog's form (numbers, or dicts without unset fields)."""
        return {
            k: v if isinstance(v, int | float) else v.model_dump(exclude_none=True) for k, v in self.overrides.items()
        }


class ScheduleSpec(_Strict):
    """A cron schedule that materializes the whole campaign."""

    cron: Cron = Field(description="Cron expression, e.g. '0 3 * * *'.")
    timezone: str = Field("UTC", description="IANA timezone of the cron expression.")
    enabled: bool = Field(False, description="Start the schedule switched on.")
