"""Cost: the one door to prices, the cost ledger, budgets and the planner
(``tests/campaign_orchestrator/costs/test_one_door.py``).

Every stage that spends money bills its work with one call, ``pricing.bill(spec, stage, usage)`` (its ledger lines,
the hardware it is billed at and a billing note), and takes its budget guard from one factory,
``pricing.guard(ctx, spec, sd, ...)``; both are thin shells over pure functions of ``campaign_orchestrator/costs/``
(``catalog.stage_bill``, ``budget.BudgetGuard``). The IO manager records every stage's cost lines in the ledger
(``campaign_orchestrator/costs/ledger.py``, where all ledger SQL lives). Only this module of the stage layer imports
cost code; the ``pricing`` resource (``resources/pricing.py``) holds the settings and hands a :class:`Pricing` over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from campaign_orchestrator.costs.catalog import (
    Catalog,
    PricingError,
    bill_at,
    billed_hardware,
    catalog_for,
    gpu_priced,
    teacher_entry,
)
from campaign_orchestrator.costs.ledger import DEFAULT_NAME, Ledger
from campaign_orchestrator.costs.meters import on_policy_meter as _on_policy_meter
from campaign_orchestrator.costs.meters import plus_lines as accrue_also  # noqa: F401 - re-exported for the stages
from campaign_orchestrator.costs.meters import teacher_meter as _teacher_meter
from campaign_orchestrator.costs.meters import timed_lines as _line_fn
from campaign_orchestrator.costs.meters import usage_lines

# numbers for people (``$0.00052``, ``21.8 s``): stages and assets format metadata with these, through this one door
from campaign_orchestrator.costs.report import dollars as dollars
from campaign_orchestrator.costs.report import seconds as seconds
from campaigns import paths
from campaigns.spec import CampaignSpec
from stages.errors import BudgetStopped, StageError, TeacherStopped

SHIPPED_CATALOG = "pricing/catalog.yaml"

PLANNED = ("teacher_generations", "student_adapter", "evaluation")  # the stages `campaign plan` estimates
STAGE_KIND = {
    "teacher_generations": "teacher",
    "student_adapter": "training",
    "evaluation": "evaluation",
    "drift_evaluation": "evaluation",
}  # the stages with a planner-checked guard (a sweep rung's is sized by it)


def ledger_path(artifact_root: str | Path, configured: str | None = None) -> Path:
    """The ledger file: ``configured`` (absolute, or relative to the artifact root) or the default."""
    root = Path(artifact_root)
    if configured:
        p = Path(configured)
        return p if p.is_absolute() else root / p
    return root / DEFAULT_NAME


@dataclass(frozen=True)
class TeacherShare:
    """One of several teachers, as its budget guard in teacher_generations sees it: ``name``, ``share`` (its
    ``budget_share`` or None), ``prompt_share`` (its share of the stage's prompts: of the planner's estimate) and
    ``earlier()`` (what the teachers asked before it accrued in this attempt, not in the ledger yet)."""

    name: str
    share: float | None
    prompt_share: float
    earlier: Callable[[], float]


def tag_lines(lines: list[dict] | None, teacher: str | None) -> list[dict] | None:
    """Cost lines tagged with the teacher they paid (the ledger's ``teacher`` column); None stays None (unknown)."""
    if lines is None or teacher is None:
        return lines
    return [x | {"teacher": teacher} for x in lines]


@dataclass(frozen=True)
class Pricing:
    """Reads the campaign's pricing catalog (``catalog`` set: it replaces the campaign's) and owns the cost ledger
    (``ledger``: the DuckDB file; default ``<artifact root>/cost_ledger.duckdb``, relative: to the root)."""

    catalog: str | None = None
    ledger: str | None = None

    # ------------------------------------------------------------------ prices
    def _catalog_path(self, spec: CampaignSpec) -> Path:
        if self.catalog:
            return paths.resolve(self.catalog)
        return spec.path(spec.cost.catalog) if spec.cost.catalog else paths.shipped_campaigns_dir() / SHIPPED_CATALOG

    def catalog_for(self, spec: CampaignSpec) -> Catalog:
        return catalog_for(spec, self._catalog_path(spec))

    def bill(self, spec: CampaignSpec, stage: str, usage: dict) -> dict:
        """What ``stage`` spent for ``usage`` (``seconds``, ``prompt_tokens``/``completion_tokens``, the
        ``device`` it ran on or the ``hardware`` key, ``parts``, ``rounds``): ``{"lines", "usd", "billed_hardware",
        "billing_note", "parts_usd"}``, ``lines`` as the ledger records them (None: an unpriced teacher,
        unknown); see ``campaign_orchestrator.costs.catalog.stage_bill``.

        On-policy training (``training.distillation.loss: on_policy``) bills its teacher scoring beside the
        training time, per round, from the trainer's summary::

            rounds = summary["on_policy"]["per_round"]        # round, teacher_prefill_tokens, ...
            scoring = pricing.bill(spec, "on_policy_scoring", {"rounds": rounds})
            lines = train_bill["lines"] + scoring["lines"]    # None: price: unpriced (unknown, never $0)

        An API teacher's prefills (prompt + student sample) are priced at its input price (one line per round,
        stamped ``round``; ``parts_usd`` per round); a self-hosted teacher scores in process and its time is in
        the training line (no line; ``billing_note`` says so). Student sampling is training-host time."""
        return bill_at(spec, self._catalog_path(spec), stage, usage)

    def price_fn(self, spec: CampaignSpec, stage: str):
        """``price(usage) -> lines`` as ``bill`` prices ``stage`` (what a Ray shard is priced with)."""
        return usage_lines(spec, self._catalog_path(spec), stage)

    def gpu_required(self, spec: CampaignSpec) -> bool:
        """``training.hardware`` is priced per GPU-hour: the trainer must find a GPU (or refuse)."""
        return gpu_priced(spec, self.catalog_for(spec))

    # ------------------------------------------------------------------ ledger and plan
    def ledger_at(self, artifact_root: str | Path) -> Ledger:
        return Ledger(ledger_path(artifact_root, self.ledger))

    def plan(self, spec: CampaignSpec, artifact_root: str | Path):
        """The campaign's :class:`~campaign_orchestrator.costs.plan.campaign.Plan`, its models resolved under
        ``artifact_root``."""
        from campaign_orchestrator import models
        from campaign_orchestrator.costs.plan.campaign import plan_campaign, plan_routed

        s = spec.student

        def where(t):
            return (
                models.resolve(t.model, artifact_root, spec.project_dir, t.revision) if t.backend != "openai" else None
            )

        student = models.resolve(s.base_model, artifact_root, spec.project_dir, s.revision)
        if spec.several_teachers:  # each teacher over its share of the prompts, at its own price
            dirs = {e.name: where(e) for e in spec.teachers}
            return plan_routed(spec, self.catalog_for(spec), spec.project_dir, dirs, student)
        return plan_campaign(spec, self.catalog_for(spec), spec.project_dir, where(spec.teacher), student)

    # ------------------------------------------------------------------ budgets
    def guard(
        self,
        ctx,
        spec: CampaignSpec,
        sd,
        clock=None,
        device: str | None = None,
        limits: list[tuple] | None = None,
        part: str | None = None,
        teacher: TeacherShare | None = None,
    ):
        """The one budget guard factory: a :class:`campaign_orchestrator.costs.budget.BudgetGuard` for the stage
        directory ``sd`` about to be computed, accruing lines priced as ``bill`` prices them.

        ``ctx``: the stage's :class:`stages.context.StageContext` (run, step, attempt, log). A stage's guard refuses
        to start when the planner's estimate does not fit the budget left (:class:`stages.errors.BudgetStopped`,
        never retried); its ``watch``/``check`` stop the stage mid-way the same way. The teacher
        stage's guard is metered (``charge``: new generations' tokens or seconds, never cache hits) and checks
        its estimate later, for the uncached share (``check_planned``). ``clock``: seconds as a float (default
        ``time.monotonic``), e.g. device time reported by the stage. ``device``: where local work will run
        ("cuda"/"cpu"): a GPU-priced stage without a GPU is refused now unless ``training.allow_cpu_fallback``.

        ``limits``: a sweep rung's guard, ``[(what, cap_usd, spent_now)]`` (what is left of each cap is
        watched, no planner check), ``part`` naming the rung within the step.

        ``teacher``: one of several teachers in teacher_generations (``spec``: the campaign as that teacher sees it,
        ``CampaignSpec.for_teacher``). Its lines are tagged with its name; the campaign's and the stage's budgets
        count what the teachers before it accrued in this attempt; its ``budget_share`` is one more limit (of
        ``cost.stage_budgets_usd.teacher_generations``, else ``cost.budget_usd``, against its own spend in the
        ledger), whose stop raises :class:`stages.errors.TeacherStopped` (the stage goes on with the others); the
        planner's estimate is scaled to its share of the prompts.

        On-policy training with an API teacher: the ``student_adapter`` guard is timed and metered; charge each
        finished round's teacher prefills as the trainer reports it (its ``on_policy_round`` message) with
        ``charge_round(guard, row)`` (this module)."""
        from campaign_orchestrator.costs.budget import BudgetGuard, Limit, limits_for
        from campaign_orchestrator.costs.memory import PlanError

        stage, c = sd.stage, spec.cost
        catalog = self.catalog_for(spec)
        ledger = self.ledger_at(sd.root)
        step = {
            "ledger": ledger,
            "campaign": spec.name,
            "stage": stage,
            "run_id": ctx.run_id,
            "step_key": ctx.step_key,
            "attempt": ctx.attempt,
            "stage_key": sd.key,
        }
        if limits is not None:  # a sweep rung: stopped inside when what it accrues crosses what is left of a cap
            return BudgetGuard(
                **step,
                limits=[Limit(what, cap, 0.0, spent_now=fn) for what, cap, fn in limits],
                line_fn=_line_fn(spec, stage, catalog, {"hardware": spec.training.hardware}),
                log=ctx.log.warning,
                part=part,
            )
        if stage not in STAGE_KIND:
            raise ValueError(f"no budget guard for stage {stage!r}; stages that spend: {sorted(STAGE_KIND)}")
        limits_ = limits_for(
            ledger,
            spec.name,
            stage,
            c.budget_usd,
            c.stage_budgets_usd.get(stage),
            ctx.run_id if c.budget_scope == "run" else None,
        )
        if teacher is not None:
            limits_ = [replace(lim, spent_now=_plus(lim.spent_before_usd, teacher.earlier)) for lim in limits_]
            limits_ += _share_limit(spec, ledger, stage, teacher, ctx.run_id if c.budget_scope == "run" else None)
        metered_stage = stage == "teacher_generations"
        if metered_stage:
            teacher_entry(spec, catalog)  # refuses a wrong entry now
        plan = None
        if limits_ and c.check_estimates and stage in PLANNED:
            try:
                plan = self.plan(spec, sd.root)
            except (PlanError, PricingError, OSError, ValueError) as e:  # spend is still watched as it accrues
                ctx.log.warning(f"budget: no planner estimate for {stage} ({e}); checking actual spend only")
        # the teacher is metered: only what its new generations report (tokens, generation seconds) is charged,
        # priced exactly as the ledger will price it; a cache hit costs nothing
        timed = {} if metered_stage else {"line_fn": _line_fn(spec, stage, catalog, {})}
        metered = {"metered": _teacher_meter(spec, catalog)} if metered_stage else {}
        stop = BudgetStopped
        if teacher is not None:
            meter, name = metered["metered"], teacher.name
            metered = {"metered": lambda u: tag_lines(meter(u), name)}
            stop = _stops_teacher(name)
        if stage == "student_adapter" and spec.training.distillation.loss == "on_policy" and spec.teacher.api:
            metered = {"metered": _on_policy_meter(spec, catalog)}  # the teacher's prefills, charged per round
        guard = BudgetGuard(
            **step,
            limits=limits_,
            log=ctx.log.info,
            on_exceeded=stop,
            **timed,
            **metered,
            **({"clock": clock} if clock is not None else {}),
            **({"part": f"teacher:{teacher.name}"} if teacher is not None else {}),
        )
        if limits_:
            ctx.log.info(
                "budget: "
                + "; ".join(
                    f"{lim.scope} spent ${lim.spent_before_usd:.6f} of ${lim.budget_usd:.6f}" for lim in limits_
                )
            )
        estimate = None if plan is None else plan.stage_usd(stage)
        if estimate is not None and teacher is not None:  # the planner priced every prompt at this teacher's price
            estimate *= teacher.prompt_share
        if estimate is not None and metered_stage:  # checked once the cache says how much is left to pay for
            guard.planned_usd = float(estimate)
        elif estimate is not None:
            guard.check_estimate(float(estimate), ledger.stage_spent(spec.name, stage, sd.key, status="interrupted"))
        if device is not None:  # billed at the hardware it will run on: refused now, before any work
            try:
                billed_hardware(
                    spec, catalog, device, what="training" if stage == "student_adapter" else "local evaluation"
                )
            except PricingError as e:
                raise StageError(str(e), retry=False) from None
        return guard


SHARE_SCOPE = "teacher {name}'s budget_share"  # the scope of a teacher's own limit (BudgetExceeded.scope)


def _plus(before: float, earlier: Callable[[], float]) -> Callable[[], float]:
    return lambda: before + float(earlier())


def _share_limit(spec: CampaignSpec, ledger: Ledger, stage: str, t: TeacherShare, run_id: str | None) -> list:
    """A teacher's ``budget_share`` of the teacher budget as a limit on its own spend in ``stage`` (none unset)."""
    from campaign_orchestrator.costs.budget import Limit

    c = spec.cost
    base = c.stage_budgets_usd.get("teacher_generations", c.budget_usd)
    if t.share is None or base is None:
        return []
    spent = ledger.teacher_spent(spec.name, t.name, asset=stage, run_id=run_id)
    scope = SHARE_SCOPE.format(name=t.name) + f" ({t.share * 100:g}% of ${base:.6f})"
    return [Limit(scope, t.share * base, spent)]


def _stops_teacher(name: str) -> Callable:
    """``on_exceeded`` of a teacher's guard: its own share stops the teacher alone, any other budget the stage."""
    own = SHARE_SCOPE.format(name=name)

    def stop(e):
        return TeacherStopped(e, name) if e.scope.startswith(own) else BudgetStopped(e)

    return stop


def charge_round(guard, row: dict) -> None:
    """Charge one finished on-policy round (the trainer's ``on_policy_round`` row: ``teacher_prefill_tokens``,
    ``samples``, optional ``teacher_completion_tokens``) to a ``student_adapter`` guard; the guard then checks the
    budget. A guard that is not metered (an in-process teacher: its time is the training's) only checks."""
    if guard is None:
        return
    if guard.metered is None:
        guard.check()
        return
    guard.charge(
        prompt_tokens=int(row.get("teacher_prefill_tokens", 0)),
        items=int(row.get("samples", 0)),
        completion_tokens=int(row.get("teacher_completion_tokens", 0)),
    )


def charge_shard(guard, msg: dict) -> None:
    """Charge one finished Ray shard (the RayJob driver's ``ray_shard`` message: ``generated``, ``failed``,
    ``prompt_tokens``, ``completion_tokens``, ``seconds``, ``final``) to a stage's guard, which then checks the
    budget: a metered guard (the teacher) prices the usage as the ledger will, a timed one (evaluation) counts its
    time. A stand-in without ``charge`` only checks."""
    if guard is None:
        return
    if not hasattr(guard, "charge"):
        guard.check()
        return
    guard.charge(
        items=int(msg.get("generated", 0)) + int(msg.get("failed", 0)),
        prompt_tokens=int(msg.get("prompt_tokens") or 0),
        completion_tokens=int(msg.get("completion_tokens") or 0),
        seconds=float(msg.get("seconds") or 0.0),
        final=bool(msg.get("final")),
    )


def refuse_student(spec: CampaignSpec, base: Path) -> list[str]:
    """What the student model at ``base`` refuses of ``spec`` (a mixture of experts' settings: experts nothing
    trains, a per-expert rank below 1, targets matching nothing), read as the planner reads the model."""
    from campaign_orchestrator.costs.memory import ModelShape, PlanError, moe_problems

    try:
        shape = ModelShape.from_model_dir(base) if (base / "config.json").exists() else None
    except PlanError:
        shape = None  # a config the planner cannot read (e.g. a stub beside a model on the cluster): the trainer checks
    return moe_problems(shape, spec.student) if shape is not None else []


def student_teacher_ratio(scores: dict, suite: str):
    from campaign_orchestrator.costs.report import student_teacher_ratio as ratio

    return ratio(scores, suite)


def report_text(report: dict) -> tuple[str, str]:
    """A cost report's "per point gained" sentence and its Markdown."""
    from campaign_orchestrator.costs.report import per_point_text, render_markdown

    return per_point_text(report), render_markdown(report)


def team_dir() -> str:
    """The team dashboard's folder name under an artifact root."""
    from campaign_orchestrator.costs.dashboard import TEAM_DIR

    return TEAM_DIR


def sweep_panel(result: dict) -> dict:
    """A sweep's result as the dashboard's sweep panel draws it."""
    from campaign_orchestrator.costs.dashboard import sweep_panel_data

    return sweep_panel_data(result)


def latest_sweep(spec: CampaignSpec, artifact_root: str | Path) -> dict | None:
    """The campaign's latest sweep as the dashboard's sweep panel draws it (README, "Sweeps"); None without one."""
    import json

    from campaign_orchestrator.costs.dashboard import sweep_panel_data

    pointer = Path(artifact_root) / spec.name / "hparam_sweep" / "LATEST.json"
    if spec.sweep is None or not pointer.exists():
        return None
    return sweep_panel_data(json.loads(pointer.read_text()))


def cost_report(
    pricing: Pricing,
    spec: CampaignSpec,
    artifact_root: str | Path,
    run_id: str,
    manifests: dict[str, dict],
    log=None,
) -> dict:
    """Build a run's cost report from the ledger, store it in the ledger, write it as JSON next to the
    campaign's dashboard (refreshed), and return it with ``report_path`` and ``dashboard_path``.
    Used by the campaign_cost asset and by ``campaign run`` (which also covers gate-blocked runs)."""
    import json

    from campaign_orchestrator.costs.dashboard import write_dashboard, write_team_dashboard
    from campaign_orchestrator.costs.report import build_report

    root = Path(artifact_root)
    ledger = pricing.ledger_at(root)
    try:
        plan = pricing.plan(spec, root)
    except Exception as e:  # noqa: BLE001 - a plan that cannot be made must not hide the actual costs
        plan = None
        if log:
            log(f"no planner estimate to compare with: {e}")
    report = build_report(
        campaign=spec.name,
        run_id=run_id,
        ledger=ledger,
        manifests=manifests,
        primary_suite=spec.evaluation.suites[0].name,
        plan=plan and plan.as_dict(),
        budget_usd=spec.cost.budget_usd,
        budget_scope=spec.cost.budget_scope,
    )
    ledger.record_report(spec.name, run_id, report)
    out = root / spec.name / "campaign_cost"
    out.mkdir(parents=True, exist_ok=True)
    report["report_path"] = str(out / f"{run_id}.json")
    report["dashboard_path"] = str(
        write_dashboard(out / "dashboard.html", spec.name, ledger, spec.cost.budget_usd, sweep=latest_sweep(spec, root))
    )
    report["team_dashboard_path"] = str(write_team_dashboard(root, ledger, {spec.name: Path(report["dashboard_path"])}))
    (out / f"{run_id}.json").write_text(json.dumps(report, indent=2, default=str))
    return report
