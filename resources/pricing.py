"""Cost resource: prices from the campaign's dated catalog, the cost ledger, budgets, the planner.

Every stage that spends money prices its work here (``hardware_line``, ``teacher_lines``) and may
take a budget guard (``budget_guard``); the IO manager records every stage's cost lines in the
ledger (see ``campaign_orchestrator/costs/ledger.py``).
"""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource, Failure
from pydantic import Field

from campaigns.spec import CampaignSpec
from campaigns import paths
from campaign_orchestrator.costs.catalog import Catalog, PricingError, read_catalog
from campaign_orchestrator.costs.ledger import DEFAULT_NAME, Ledger
from campaign_orchestrator.costs.lines import compute_line, teacher_entry, teacher_lines

SHIPPED_CATALOG = "pricing/catalog.yaml"

PLANNED = ("teacher_generations", "student_adapter", "evaluation")  # the stages `campaign plan` estimates
STAGE_KIND = {"teacher_generations": "teacher", "student_adapter": "training", "evaluation": "evaluation",
              "drift_evaluation": "evaluation"}


def ledger_path(artifact_root: str | Path, configured: str | None = None) -> Path:
    """The ledger file: ``configured`` (absolute, or relative to the artifact root) or the default."""
    root = Path(artifact_root)
    if configured:
        p = Path(configured)
        return p if p.is_absolute() else root / p
    return root / DEFAULT_NAME


class BudgetStop(Failure):
    """A budget stop, as a Dagster failure that is never retried (retrying cannot make money appear)."""

    def __init__(self, exc):
        super().__init__(description=str(exc), metadata=exc.metadata(), allow_retries=False)
        self.budget = exc


class PricingResource(ConfigurableResource):
    """Reads the campaign's pricing catalog (a `catalog` set here replaces the campaign's) and
    owns the cost ledger."""

    catalog: str | None = Field(None, description="Pricing catalog replacing every campaign's `cost.catalog`.")
    ledger: str | None = Field(
        None, description="DuckDB cost ledger file; default <artifact root>/cost_ledger.duckdb (relative: to the root).")

    # ------------------------------------------------------------------ prices
    def _catalog_path(self, spec: CampaignSpec) -> Path:
        if self.catalog:
            return paths.resolve(self.catalog)
        return spec.path(spec.cost.catalog) if spec.cost.catalog else paths.shipped_campaigns_dir() / SHIPPED_CATALOG

    def catalog_for(self, spec: CampaignSpec) -> Catalog:
        c = spec.cost
        return read_catalog(self._catalog_path(spec), c.price_overrides(), expect_version=c.catalog_version)

    def hardware_line(self, spec: CampaignSpec, kind: str, hardware: str, seconds: float, hosts: int = 1,
                      devices: int = 1) -> dict:
        """One line for ``seconds`` on catalog entry ``hardware`` at the campaign's pricing tier."""
        entry = self.catalog_for(spec).get(hardware)
        return compute_line(kind, entry, seconds, hosts=hosts, devices=devices, tier=spec.cost.pricing_tier)

    def teacher_lines(self, spec: CampaignSpec, seconds: float, prompt_tokens: int, completion_tokens: int,
                      kind: str = "teacher") -> list[dict] | None:
        """The teacher's spend, by its one price field (``teacher.price`` for an API, ``teacher.hardware``
        self-hosted; ``campaign_orchestrator.costs.lines.teacher_lines``); None when it is unpriced."""
        return teacher_lines(spec, self.catalog_for(spec), seconds, prompt_tokens, completion_tokens, kind=kind)

    # ------------------------------------------------------------------ ledger and plan
    def ledger_at(self, artifact_root: str | Path) -> Ledger:
        return Ledger(ledger_path(artifact_root, self.ledger))

    def plan(self, spec: CampaignSpec, artifact_root: str | Path) -> dict:
        from campaign_orchestrator.costs.planner import plan_campaign

        from campaign_orchestrator import models

        t, s = spec.teacher, spec.student
        return plan_campaign(spec, self.catalog_for(spec), spec.project_dir,
                             models.resolve(t.model, artifact_root, spec.project_dir, t.revision)
                             if t.backend != "openai" else None,
                             models.resolve(s.base_model, artifact_root, spec.project_dir, s.revision))

    # ------------------------------------------------------------------ budgets
    def budget_guard(self, context, spec: CampaignSpec, sd, clock=None):
        """A :class:`campaign_orchestrator.costs.budget.BudgetGuard` for the stage directory ``sd`` about to be computed:
        refuses to start when the planner's estimate does not fit the budget left (Dagster
        ``Failure``, not retried); its ``watch``/``check`` stop the stage mid-way the same way.
        The teacher stage's guard is metered (``charge``: new generations' tokens or seconds, never
        cache hits) and checks its estimate later, for the uncached share (``check_planned``).
        ``clock``: seconds as a float (default ``time.monotonic``), e.g. device time reported by the stage."""
        from campaign_orchestrator.costs.budget import BudgetGuard, limits_for
        from campaign_orchestrator.costs.planner import PlanError

        stage, c = sd.stage, spec.cost
        if stage not in STAGE_KIND:
            raise ValueError(f"no budget guard for stage {stage!r}; stages that spend: {sorted(STAGE_KIND)}")
        ledger = self.ledger_at(sd.root)
        run_id = context.run_id
        limits = limits_for(ledger, spec.name, stage, c.budget_usd, c.stage_budgets_usd.get(stage),
                            run_id if c.budget_scope == "run" else None)
        catalog = self.catalog_for(spec)
        teacher = stage == "teacher_generations"
        if teacher:
            teacher_entry(spec, catalog)  # refuses a wrong entry now
        plan = None
        if limits and c.check_estimates and stage in PLANNED:
            try:
                plan = self.plan(spec, sd.root)
            except (PlanError, PricingError, OSError, ValueError) as e:  # spend is still watched as it accrues
                context.log.warning(f"budget: no planner estimate for {stage} ({e}); checking actual spend only")
        # the teacher is metered: only what its new generations report (tokens, generation seconds) is charged,
        # priced exactly as the ledger will price it; a cache hit costs nothing
        timed = {} if teacher else {"line_fn": _line_fn(spec, stage, catalog)}
        metered = {"metered": _teacher_meter(spec, catalog)} if teacher else {}
        guard = BudgetGuard(ledger=ledger, campaign=spec.name, stage=stage, run_id=run_id,
                            step_key=context.get_step_execution_context().step.key, attempt=context.retry_number,
                            stage_key=sd.key, limits=limits, log=context.log.info, on_exceeded=BudgetStop,
                            **timed, **metered, **({"clock": clock} if clock is not None else {}))
        if limits:
            context.log.info("budget: " + "; ".join(f"{lim.scope} spent ${lim.spent_before_usd:.6f} of "
                                                    f"${lim.budget_usd:.6f}" for lim in limits))
        estimate = None if plan is None else (plan["stages"].get(stage) or {}).get("usd")
        if estimate is not None and teacher:  # checked once the cache says how much is left to pay for
            guard.planned_usd = float(estimate)
        elif estimate is not None:
            earlier = ledger.stage_spent(spec.name, stage, sd.key, status="interrupted")
            guard.check_estimate(float(estimate), float(earlier))
        return guard


def _teacher_meter(spec: CampaignSpec, catalog: Catalog):
    """The teacher guard's lines for the usage its new generations reported: ``teacher_lines``, the ledger's own
    pricing (an unpriced teacher accrues nothing: the spec refuses a budget over it)."""
    return lambda u: teacher_lines(spec, catalog, u.seconds, u.prompt_tokens, u.completion_tokens) or []


def _line_fn(spec: CampaignSpec, stage: str, catalog: Catalog):
    """Cost lines of ``seconds`` of work for a timed stage (what the guard accrues; the teacher is metered)."""
    tr, tier = spec.training, spec.cost.pricing_tier
    kind = STAGE_KIND[stage]
    entry = catalog.get(tr.hardware)
    if stage == "student_adapter":
        return lambda seconds, items: [compute_line(kind, entry, seconds, hosts=tr.nodes, devices=tr.world_size, tier=tier)]
    return lambda seconds, items: [compute_line(kind, entry, seconds, tier=tier)]


def latest_sweep(spec: CampaignSpec, artifact_root: str | Path) -> dict | None:
    """The campaign's latest sweep as the dashboard's sweep panel draws it (README, "Sweeps"); None without one."""
    import json

    from campaign_orchestrator.costs.dashboard import sweep_panel_data

    pointer = Path(artifact_root) / spec.name / "hparam_sweep" / "LATEST.json"
    if spec.sweep is None or not pointer.exists():
        return None
    return sweep_panel_data(json.loads(pointer.read_text()))


def cost_report(pricing: PricingResource, spec: CampaignSpec, artifact_root: str | Path, run_id: str,
                manifests: dict[str, dict], log=None) -> dict:
    """Build a run's cost report from the ledger, store it in the ledger, write it as JSON next to the
    campaign's dashboard (refreshed), and return it with ``report_path`` and ``dashboard_path``.
    Used by the campaign_cost asset and by ``campaign run`` (which also covers gate-blocked runs)."""
    import json

    from campaign_orchestrator.costs.dashboard import write_dashboard
    from campaign_orchestrator.costs.report import build_report

    root = Path(artifact_root)
    ledger = pricing.ledger_at(root)
    try:
        plan = pricing.plan(spec, root)
    except Exception as e:  # noqa: BLE001 - a plan that cannot be made must not hide the actual costs
        plan = None
        if log:
            log(f"no planner estimate to compare with: {e}")
    report = build_report(campaign=spec.name, run_id=run_id, ledger=ledger, manifests=manifests,
                          primary_suite=spec.evaluation.suites[0].name, plan=plan, budget_usd=spec.cost.budget_usd,
                          budget_scope=spec.cost.budget_scope)
    ledger.record_report(spec.name, run_id, report)
    out = root / spec.name / "campaign_cost"
    out.mkdir(parents=True, exist_ok=True)
    report["report_path"] = str(out / f"{run_id}.json")
    report["dashboard_path"] = str(write_dashboard(out / "dashboard.html", spec.name, ledger, spec.cost.budget_usd,
                                                   sweep=latest_sweep(spec, root)))
    (out / f"{run_id}.json").write_text(json.dumps(report, indent=2, default=str))
    return report
