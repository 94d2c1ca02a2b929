"""campaign_cost: what this campaign's result cost (``stages/campaign_cost.py``), from the cost ledger, next to the
planner's estimates, with the campaign's dashboard (a static HTML page) linked from its metadata.

It sits downstream of evaluation, so when the gate blocks (a blocking asset check) Dagster skips
it in that run: a cost *per result* is not reported for a result that is not shipped. The spend
of a blocked run is still in the ledger (every stage records its lines as it materializes);
`campaign run` prints it and refreshes the dashboard, and `campaign costs NAME` shows it.
"""

import math

from dagster import AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import dagster_failures, key, rounded, stage_context, tag_run
from campaigns.spec import CampaignSpec
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from stages import campaign_cost as stage
from stages.campaign_cost import result_line
from stages.pricing import dollars, report_text

# numeric report fields shown as metadata; Dagster plots them across materializations
PLOTTED = (
    "total_usd",
    "teacher_usd",
    "training_usd",
    "evaluation_usd",
    "interrupted_usd",
    "spent_this_run_usd",
    "campaign_spent_usd",
    "usd_per_million_teacher_tokens",
    "usd_per_1k_accepted_examples",
    "usd_per_point_gained_lcb",
    "usd_per_point_gained",
    "gain_points",
    "gain_points_low",
    "gpu_hours",
    "host_hours",
    "teacher_tokens",
    "accepted_examples",
    "teacher_tokens_per_s",
    "training_tokens_per_s",
    "budget_remaining_usd",
    "budget_used_fraction",
    "plan_total_usd",
    "candidate_score",
    "base_score",
)


# counts among them: shown as integers (a float rounded to 4 figures read 50520 for 50,522 tokens)
COUNTS = ("teacher_tokens", "accepted_examples")


def report_metadata(report: dict, dashboard_url: str | None = None) -> dict:
    """The report as metadata: the result for people in one line, the plotted figures (numbers, rounded: Dagster
    plots them across materializations; counts as integers), the report in markdown, and the dashboards as links a
    browser opens from the UI (``dashboard_url``: where they are served)."""
    md = {"result": result_line(report)}
    md |= rounded(
        {
            k: int(report[k]) if k in COUNTS else float(report[k])
            for k in PLOTTED
            if isinstance(report.get(k), int | float) and math.isfinite(float(report[k]))
        }
    )
    per_point, markdown = report_text(report)
    md["per_point_gained"] = per_point
    md["report"] = MetadataValue.md(markdown)
    md["report_json"] = MetadataValue.path(report["report_path"])
    if dashboard_url:
        base = dashboard_url.rstrip("/")
        md["dashboard"] = MetadataValue.url(f"{base}/{report['campaign']}.html")
        md["team_dashboard"] = MetadataValue.url(f"{base}/index.html")
    md["dashboard_file"] = MetadataValue.path(report["dashboard_path"])
    return md


def build(spec: CampaignSpec):
    ins = {s: AssetIn(key(spec, s)) for s in stage.upstream(spec)}
    if spec.sweep is not None:  # the candidate came out of the sweep: its trials are part of the result's cost
        ins["hparam_sweep"] = AssetIn(key(spec, "hparam_sweep"))

    @asset(
        key=key(spec, "campaign_cost"),
        group_name=spec.name,
        kinds={"duckdb"},
        ins=ins,
        description="Cost per result from the ledger: $/M teacher tokens, $/1k accepted examples, $/point "
        "gained (at the gain's lower 95% bound), planner estimate vs actual, and the cost "
        "dashboard.",
    )
    def campaign_cost(
        context: AssetExecutionContext, storage: ArtifactStore, pricing: PricingResource, **manifests: dict
    ) -> Output[dict]:
        # one manifest per upstream stage in ``ins`` (a fully on-policy campaign has no teacher stages)
        ctx = stage_context(context, storage, pricing)
        with dagster_failures():
            out = stage.run(spec, manifests, ctx)
        r = out.manifest
        tag_run(context, verdict=r.get("verdict") or "not evaluated", cost=dollars(r.get("total_usd")))
        # where the dashboards are served: the resource's URL, else where `campaign dashboard --serve` serves them
        url = pricing.dashboard_url or stage.dashboards_url(ctx.store.root_path())
        return Output(r, metadata=report_metadata(r, url))

    return campaign_cost
