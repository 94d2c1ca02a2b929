"""Prices for every stage, from the dated catalog the campaign names (with its overrides)."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource

from costs.catalog import PriceEntry, get, load_catalog

REPO_ROOT = Path(__file__).resolve().parent.parent


class PricingResource(ConfigurableResource):
    """Reads the campaign's pricing catalog; a `catalog` set here replaces the campaign's."""

    catalog: str | None = None

    def entries(self, campaign_catalog: str, overrides: dict[str, float]) -> dict[str, PriceEntry]:
        p = Path(self.catalog or campaign_catalog)
        return load_catalog(p if p.is_absolute() else REPO_ROOT / p, overrides)

    def price(self, key: str, campaign_catalog: str, overrides: dict[str, float]) -> PriceEntry:
        return get(self.entries(campaign_catalog, overrides), key)
