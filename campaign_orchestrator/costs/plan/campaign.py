"""The whole plan of a campaign (:class:`Plan`): its data facts, the student's memory per device and whether it
fits, every stage's estimate, the total against the budget, and the teacher stage's replica table on Ray."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from campaign_orchestrator.costs.catalog import Catalog
from campaign_orchestrator.costs.memory import ModelShape
from campaign_orchestrator.costs.plan.facts import DataFacts, data_facts
from campaign_orchestrator.costs.plan.fit import memory_fit
from campaign_orchestrator.costs.plan.scaleout import ScaleOut, plan_scaleout
from campaign_orchestrator.costs.plan.stages import EvaluationEstimate, StageEstimate, TeacherEstimate, plan_stages
from campaigns.spec import CampaignSpec


@dataclass
class Plan:
    """A campaign's plan (``campaign plan``; ``as_dict`` is its JSON). ``total_usd`` None: some stage's dollars are
    unknown (``unknown`` lists them), never a silent $0."""

    campaign: str
    catalog: str
    catalog_version: str
    pricing_tier: str
    data: DataFacts
    student: ModelShape
    teacher: ModelShape | None
    memory: dict  # costs.memory.training_memory's table, with the device fit (plan.fit.memory_fit)
    stages: dict[str, StageEstimate]
    total_usd: float | None
    unknown: list[str]
    budget_usd: float | None
    within_budget: bool | None
    scaleout: ScaleOut | None = None
    campaign_spent_usd: float | None = None  # the ledger's spend, when the caller read it
    teachers: dict | None = None  # several teachers: each one's shares and dollars (:func:`plan_routed`)

    def as_dict(self) -> dict:
        return asdict(self)

    def stage_usd(self, stage: str) -> float | None:
        """The stage's estimated dollars; None when it is unknown or the plan has no such stage."""
        est = self.stages.get(stage)
        return None if est is None else est.usd


def plan_campaign(
    spec: CampaignSpec, catalog: Catalog, repo_root: Path, teacher_dir: Path | None, student_dir: Path
) -> Plan:
    """The whole plan: data facts, per-device memory and fit, and per-stage estimates."""
    student = ModelShape.from_model_dir(student_dir)
    teacher = (
        ModelShape.from_model_dir(teacher_dir)
        if teacher_dir is not None and (Path(teacher_dir) / "config.json").exists()
        else None
    )
    facts = data_facts(spec, repo_root, teacher_dir, student_dir)
    spec, mem = memory_fit(spec, catalog, facts, student)  # `auto` micro-batch and policy resolved
    stages = plan_stages(spec, catalog, facts, teacher, student)
    unknown = [f"{name}: {s.unknown}" for name, s in stages.items() if s.usd is None]
    total = None if unknown else sum(s.usd for s in stages.values())  # never a silent $0 for what is unpriced
    budget = spec.cost.budget_usd
    plan = Plan(
        campaign=spec.name,
        catalog=catalog.path,
        catalog_version=catalog.version,
        pricing_tier=spec.cost.pricing_tier,
        data=facts,
        student=student,
        teacher=teacher,
        memory=mem,
        stages=stages,
        total_usd=total,
        unknown=unknown,
        budget_usd=budget,
        within_budget=None if budget is None or total is None else total <= budget,
    )
    if spec.execution.executor == "ray" and "teacher_generations" in stages:  # the teacher stage on 1..64 replicas
        plan.scaleout = plan_scaleout(spec, catalog, facts, teacher)
    return plan


MIXED = "(per teacher)"  # the unit of a stage estimate that adds several teachers' prices (render.py lists them)


def plan_routed(
    spec: CampaignSpec, catalog: Catalog, repo_root: Path, teacher_dirs: dict[str, Path | None], student_dir: Path
) -> Plan:
    """Several teachers routed by category: the plan of the default teacher's view (data, memory, training), with
    the teacher stage the sum of each teacher's estimate over its share of the training prompts and the teacher's
    part of evaluation the sum over its share of the held-out items (each at its own price); ``teachers``: each
    one's shares and dollars."""
    from campaign_orchestrator.costs.plan.facts import route_shares

    shares = route_shares(spec, repo_root)
    plans = {
        e.name: plan_campaign(spec.for_teacher(e), catalog, repo_root, teacher_dirs.get(e.name), student_dir)
        for e in spec.teachers
    }
    plan = plans[spec.teacher.default.name]
    per: dict[str, dict] = {n: {"train_share": shares[n][0], "heldout_share": shares[n][1]} for n in plans}
    gen = [(n, p.stages.get("teacher_generations"), shares[n][0]) for n, p in plans.items()]
    if all(est is not None for _n, est, _s in gen):
        parts = [_scaled(est, share) for _n, est, share in gen]
        for (n, _e, _s), part in zip(gen, parts, strict=True):
            per[n]["teacher_generations_usd"] = part.usd
        plan.stages["teacher_generations"] = _added(parts)
    ev = plan.stages.get("evaluation")
    if isinstance(ev, EvaluationEstimate) and spec.evaluation.score_teacher:
        scoring = {n: p.stages["evaluation"].teacher_usd for n, p in plans.items()}
        local = None if ev.usd is None or ev.teacher_usd is None else ev.usd - ev.teacher_usd
        for n, usd in scoring.items():
            per[n]["scoring_usd"] = None if usd is None else usd * shares[n][1]
        teacher_usd = (
            None if any(v["scoring_usd"] is None for v in per.values()) else sum(v["scoring_usd"] for v in per.values())
        )
        ev.teacher_usd, ev.teacher_price_key = teacher_usd, MIXED
        ev.usd = None if local is None or teacher_usd is None else local + teacher_usd
    plan.unknown = [f"{name}: {st.unknown}" for name, st in plan.stages.items() if st.usd is None]
    plan.total_usd = None if plan.unknown else sum(st.usd for st in plan.stages.values())
    b = spec.cost.budget_usd
    plan.within_budget = None if b is None or plan.total_usd is None else plan.total_usd <= b
    plan.teachers = per
    return plan


def _scaled(est: TeacherEstimate, share: float) -> TeacherEstimate:
    """A teacher's estimate over every prompt, scaled to its share of them."""
    return replace(
        est,
        requests=round(est.requests * share),
        prompt_tokens=est.prompt_tokens * share,
        completion_tokens=est.completion_tokens * share,
        tokens=est.tokens * share,
        quantity=est.quantity * share,
        seconds=None if est.seconds is None else est.seconds * share,
        usd=None if est.usd is None else est.usd * share,
    )


def _added(parts: list[TeacherEstimate]) -> TeacherEstimate:
    """Several teachers' estimates as one stage row: counts and dollars added (None when any is unknown), one
    quantity where they share a unit, else :data:`MIXED`."""
    units = {p.unit for p in parts}
    same = len(units) == 1
    unknown = [p.unknown for p in parts if p.usd is None]
    return TeacherEstimate(
        requests=sum(p.requests for p in parts),
        prompt_tokens=sum(p.prompt_tokens for p in parts),
        completion_tokens=sum(p.completion_tokens for p in parts),
        tokens=sum(p.tokens for p in parts),
        seconds=None if any(p.seconds is None for p in parts) else sum(p.seconds for p in parts),
        price_key=" + ".join(dict.fromkeys(p.price_key for p in parts)),
        unit=units.pop() if same else MIXED,
        quantity=sum(p.quantity for p in parts) if same else 0.0,
        usd=None if unknown else sum(p.usd for p in parts),
        unknown=unknown[0] if unknown else None,
    )
