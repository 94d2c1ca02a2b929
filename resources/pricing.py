"""The ``pricing`` resource: which pricing catalog and cost ledger this deployment uses, and where its cost
dashboards are served. It hands the stages a plain :class:`stages.pricing.Pricing` (``service()``), the one door to
prices, the ledger, budgets and the planner (``tests/campaign_orchestrator/costs/test_one_door.py``)."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from stages.pricing import Pricing


class PricingResource(ConfigurableResource):
    """The campaign's pricing catalog (a `catalog` set here replaces the campaign's) and the cost ledger."""

    catalog: str | None = Field(None, description="Pricing catalog replacing every campaign's `cost.catalog`.")
    ledger: str | None = Field(
        None, description="DuckDB cost ledger file; default <artifact root>/cost_ledger.duckdb (relative: to the root)."
    )
    dashboard_url: str | None = Field(
        None,
        description="Where a web server serves <artifact root>/dashboards/ (the cost dashboards the UI links to). "
        "Unset: where `campaign dashboard --serve` serves them (the URL it records when it starts; before it first "
        "served, http://127.0.0.1:8765).",
    )

    def service(self) -> Pricing:
        """The plain pricing service these settings describe (what the stages get)."""
        return Pricing(catalog=self.catalog, ledger=self.ledger)
