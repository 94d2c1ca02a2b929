"""``campaign validate``, ``list`` and ``plan``: campaign files before anything runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from campaign_app.cli.common import EXIT_INVALID, EXIT_OK, resolve_spec
from campaigns.loader import default_campaign_files, load_campaigns


def price_problems(spec) -> list[str]:
    """What the campaign's pricing catalog cannot price (teacher.price / teacher.hardware, training.hardware):
    found here, not as a traceback at `campaign run`."""
    from campaign_orchestrator.costs.catalog import PricingError
    from campaign_orchestrator.costs.catalog import price_problems as problems
    from campaign_orchestrator.costs.plan.stages import sweep_cap_problems
    from stages.pricing import Pricing

    try:
        catalog = Pricing().catalog_for(spec)
        return problems(spec, catalog) + sweep_cap_problems(spec, catalog)
    except PricingError as e:  # the catalog itself (missing, unreadable, another version than pinned)
        return [str(e)]


def validate_command(args: argparse.Namespace) -> int:
    files = args.files or default_campaign_files()
    missing = [f for f in files if not Path(f).exists()]
    loaded = load_campaigns([f for f in files if Path(f).exists()], check_files=True)  # every problem at once
    bad_names = set()
    for name, src in loaded.sources.items():
        spec = loaded.campaigns[name]
        priced, model = price_problems(spec), student_model_problems(spec, args.artifacts)
        if priced or model:
            bad_names.add(name)
            print(
                f"invalid  {src}  (campaign {name}" + (": its student model refuses these settings)" if model else ")")
            )
            for line in [*priced, *model]:
                print(f"  {src}: {line}")
            continue
        print(f"ok       {src}  (campaign {name})")
    for f in missing:
        print(f"invalid  {f}: no such file")
    for err in loaded.errors:
        print(f"invalid  {err.path}")
        for line in err.render().splitlines():
            print(f"  {line}")
    bad = len(loaded.errors) + len(missing) + len(bad_names)
    print(f"\n{len(loaded.campaigns) - len(bad_names)} valid, {bad} invalid")
    return EXIT_INVALID if bad else EXIT_OK


def student_model_problems(spec, artifacts: str | None) -> list[str]:
    """The student settings its model refuses (a mixture of experts: what trains the experts, the per-expert
    rank), read from the model's config.json when it is on disk (a demo model built under ``artifacts``, a
    directory); a model that is not there is checked when the campaign runs."""
    from campaign_orchestrator.costs.memory import ModelShape, PlanError, moe_problems
    from campaign_orchestrator.demo import recipe
    from resources.storage import ArtifactStore

    ref = spec.student.base_model
    try:
        d = (
            recipe.resolve(ref, ArtifactStore(root=artifacts).root_path())
            if recipe.is_demo_ref(ref)
            else spec.path(ref)
        )
        shape = ModelShape.from_model_dir(d) if (d / "config.json").exists() else None
    except (ValueError, PlanError, OSError):
        return []  # an unknown or unreadable model is reported where it is loaded
    return moe_problems(shape, spec.student) if shape is not None else []


def list_command(args: argparse.Namespace) -> int:
    loaded = load_campaigns()
    for name, src in loaded.sources.items():
        print(f"{name:24s} {src}")
    for e in loaded.errors:
        print(f"{'(invalid)':24s} {e.path}")
    return EXIT_OK


def plan_command(args: argparse.Namespace) -> int:
    from campaign_orchestrator.costs.catalog import PricingError
    from campaign_orchestrator.costs.memory import PlanError
    from campaign_orchestrator.costs.plan.render import render_plan
    from resources.storage import ArtifactStore
    from stages.pricing import Pricing

    spec = resolve_spec(args.campaign)
    if spec is None:
        return EXIT_INVALID
    root = ArtifactStore(root=args.artifacts).root_path()
    pricing = Pricing()
    try:
        plan = pricing.plan(spec, root)
        if args.replicas or args.assume:  # the teacher stage on the replica counts asked for, any executor
            plan.scaleout = scaleout_plan(spec, pricing, plan, args.replicas, args.assume)
    except (PlanError, PricingError, FileNotFoundError, ValueError) as e:
        print(f"cannot plan campaign {spec.name}: {e}", file=sys.stderr)
        return EXIT_INVALID
    spent = pricing.ledger_at(root).spent(spec.name)
    plan.campaign_spent_usd = spent
    checks = recipe_checks(spec, plan, root)  # campaign_orchestrator/recipe_checks.py on the plan's data facts
    if args.json:
        print(json.dumps(plan.as_dict() | {"recipe_checks": [f.as_dict() for f in checks]}, indent=2, default=str))
        return EXIT_OK
    print(render_plan(plan))
    from campaign_orchestrator.recipe_checks import render

    print(render(checks))
    if spent:
        print(
            f"already spent on campaign {spec.name} (ledger): ${spent:.6f}"
            + (f"; ${spec.cost.budget_usd - spent:.6f} of the budget remains" if spec.cost.budget_usd else "")
        )
    return EXIT_OK


def scaleout_plan(spec, pricing, plan, replicas: str | None, assume: list[str] | None):
    """``--replicas 1,2,4`` and ``--assume key=value``: the teacher stage's replica table (``plan``: the campaign's
    ``Plan``; ``costs.plan.scaleout.plan_scaleout``)."""
    from campaign_orchestrator.costs.memory import PlanError
    from campaign_orchestrator.costs.plan.scaleout import ScaleAssumptions, plan_scaleout

    try:
        counts = [int(x) for x in replicas.split(",") if x.strip()] if replicas else None
        pairs = dict(a.split("=", 1) for a in assume or [])
        assumptions = ScaleAssumptions().with_overrides({k.strip(): float(v) for k, v in pairs.items()})
    except ValueError:
        raise PlanError(
            f"--replicas takes counts like 1,2,4,8 and --assume key=number (known: "
            f"{', '.join(ScaleAssumptions.__dataclass_fields__)}); got {replicas!r}, {assume!r}"
        ) from None
    return plan_scaleout(spec, pricing.catalog_for(spec), plan.data, plan.teacher, counts, assumptions)


def docs_command(args: argparse.Namespace) -> int:
    from campaigns import fieldref

    if args.check:
        if fieldref.is_current():
            print(f"{fieldref.reference_path()} is current")
            return EXIT_OK
        print(
            f"{fieldref.reference_path()} is out of date with campaigns/spec/: run `campaign docs` and commit it",
            file=sys.stderr,
        )
        return EXIT_INVALID
    print(f"wrote {fieldref.write()}")
    return EXIT_OK


def add_parsers(sub) -> None:
    """Register this group's commands on the ``campaign`` parser."""
    v = sub.add_parser("validate", help="validate campaign files (default: campaigns/*.yaml)")
    v.add_argument("files", nargs="*")
    v.add_argument(
        "--artifacts", default="artifacts", help="artifact root holding the demo models (their configs are read)"
    )
    v.set_defaults(fn=validate_command)
    p = sub.add_parser("plan", help="before running: per-GPU memory, fit, teacher tokens, GPU-hours and $ per stage")
    p.add_argument("campaign", help="campaign name or YAML file")
    p.add_argument("--artifacts", default="artifacts", help="artifact root holding models and the ledger")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--replicas",
        help="estimate the teacher stage on these Ray replica counts, e.g. 1,2,4,8,16 "
        "(default with execution.executor ray: 1..64 and execution.replicas)",
    )
    p.add_argument(
        "--assume",
        action="append",
        metavar="KEY=VALUE",
        help="a scale-out assumption, e.g. cluster_start_s=5 (costs.plan.scaleout.ScaleAssumptions)",
    )
    p.set_defaults(fn=plan_command)
    ls = sub.add_parser("list", help="list campaigns")
    ls.set_defaults(fn=list_command)
    d = sub.add_parser("docs", help="write the campaign field reference (docs/campaign-fields.md) from the spec")
    d.add_argument("--check", action="store_true", help="exit 1 when the checked-in reference is not current")
    d.set_defaults(fn=docs_command)


def recipe_checks(spec, plan, root=None) -> list:
    """The recipe checks (campaign_orchestrator/recipe_checks.py) on the plan's data facts (``plan``: a ``Plan``) and
    the campaign's last evaluated diagnosis under the artifact root ``root``, if any."""
    from campaign_orchestrator.costs.memory_policy import resolved_spec
    from campaign_orchestrator.recipe_checks import check_recipe, facts_from_plan, latest_diagnosis

    spec = resolved_spec(spec, plan.memory.get("training_policy"))  # `auto` as the trainer will run it
    available = None
    if spec.data.replay is not None:
        from campaign_orchestrator.dataset.replay import read_prompts

        available = len(read_prompts(spec.path(spec.data.replay.source)))
    diagnosis = latest_diagnosis(Path(root) / spec.name) if root is not None else None
    return check_recipe(spec, facts_from_plan(spec, plan.data, available), diagnosis)
