"""The whole plan of a campaign (:class:`Plan`): its data facts, the student's memory per device and whether it
fits, every stage's estimate, the total against the budget, and the teacher stage's replica table on Ray."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from campaign_orchestrator.costs.catalog import Catalog
from campaign_orchestrator.costs.memory import ModelShape
from campaign_orchestrator.costs.plan.facts import DataFacts, data_facts
from campaign_orchestrator.costs.plan.fit import memory_fit
from campaign_orchestrator.costs.plan.scaleout import ScaleOut, plan_scaleout
from campaign_orchestrator.costs.plan.stages import StageEstimate, plan_stages
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
