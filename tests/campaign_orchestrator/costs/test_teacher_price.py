"""One price field for the teacher, and no silent zero.

An API teacher is priced by `teacher.price` alone (a per-million-token catalog entry, or its override);
a self-hosted one by `teacher.hardware` alone. The planner, the budget guard and the recorded cost read
the same entry (campaign_orchestrator.costs.catalog.teacher_entry). A missing price is refused by
`campaign validate`; `price: unpriced` runs, and every figure that depends on it says "unknown"."""

from __future__ import annotations

import pytest
import yaml
from dagster import DagsterInstance, materialize

from campaign_app import cli
from campaigns.loader import load_campaign_file
from tests.support import REPO_ROOT
from tests.support.testserver import ServerThread

OVERRIDE = {"api-open-70b": {"input_usd": 2.0, "output_usd": 4.0, "source": "our contract"}}


def _campaign(tmp_path, teacher: dict, cost: dict | None = None, name: str = "priced"):
    d = yaml.safe_load((REPO_ROOT / "campaigns/demo.yaml").read_text())
    from campaign_orchestrator.demo import cipher

    data = cipher.write_jsonl(cipher.items(60, seed=3), tmp_path / "data.jsonl")
    d |= {"name": name, "teacher": teacher, "cost": cost or {}}
    d["data"]["source"] = str(data)
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _api(price=None, **kw) -> dict:
    t = {
        "backend": "openai",
        "model": "teacher",
        "base_url": "http://127.0.0.1:9/v1",
        "sampling": {"max_new_tokens": 16},
        **kw,
    }
    return t | ({"price": price} if price is not None else {})


@pytest.mark.parametrize(
    "teacher,cost,says",
    [
        (_api(), None, "teacher: an API teacher (backend 'openai') is priced by `price`"),
        (
            _api("api-open-70b", hardware="cpu-2vcpu"),
            None,
            "an API teacher (backend 'openai') is priced by `price` alone",
        ),
        (
            _api("h100-sxm"),
            None,
            "teacher.price 'h100-sxm' is priced per gpu-hour; an API teacher needs an entry priced per million tokens",
        ),
        (_api("no-such-entry"), None, "no price entry 'no-such-entry' in the pricing catalog"),
        (
            {"model": "@demo/teacher", "hardware": "api-open-70b"},
            None,
            "teacher.hardware 'api-open-70b' is priced per million-tokens; a self-hosted teacher runs on",
        ),
        ({"model": "@demo/teacher"}, None, "a self-hosted teacher (backend 'transformers') is priced by `hardware`"),
        (
            _api("unpriced"),
            {"budget_usd": 5.0},
            "teacher.price is `unpriced`, so its spend is unknown and cost.budget_usd (5.0) cannot be kept",
        ),
    ],
)
def test_validate_refuses_a_teacher_it_cannot_price(tmp_path, capsys, teacher, cost, says):
    path = _campaign(tmp_path, teacher, cost)
    assert cli.main(["validate", str(path)]) == cli.EXIT_INVALID
    out = capsys.readouterr().out
    assert says in out, out


def test_planner_guard_and_ledger_read_the_same_price(tmp_path, artifact_root):
    """The README's openai example: before, the planner read `teacher.hardware` (cpu-2vcpu, hourly) and
    failed for want of a local model to size; now all three price its tokens at `teacher.price`."""
    from campaign_orchestrator.costs.budget import Usage
    from campaign_orchestrator.costs.catalog import teacher_entry
    from campaign_orchestrator.generation.runner import GenerationStats
    from stages.pricing import Pricing, _teacher_meter
    from stages.teacher import teacher_usage

    spec = load_campaign_file(_campaign(tmp_path, _api("api-open-70b"), {"overrides": OVERRIDE}))
    assert cli.main(["validate", str(tmp_path / "priced.yaml")]) == cli.EXIT_OK
    pricing = Pricing()
    catalog = pricing.catalog_for(spec)
    assert (teacher_entry(spec, catalog).input_usd, teacher_entry(spec, catalog).output_usd) == (2.0, 4.0)

    plan = pricing.plan(spec, artifact_root)
    t = plan.stages["teacher_generations"]
    assert t.price_key == "api-open-70b" and t.unit == "million-tokens"
    assert t.usd == pytest.approx(t.prompt_tokens * 2e-6 + t.completion_tokens * 4e-6)

    ledger = pricing.bill(
        spec,
        "teacher_generations",
        teacher_usage(GenerationStats(new_prompt_tokens=1_000_000, new_completion_tokens=500_000)),
    )["lines"]
    assert {x["price_key"]: x["usd"] for x in ledger} == {"api-open-70b:input": 2.0, "api-open-70b:output": 2.0}

    # the guard is charged the tokens the new generations reported, priced as the ledger prices them
    guard_lines = _teacher_meter(spec, catalog)(
        Usage(items=7, prompt_tokens=1_000_000, completion_tokens=500_000, seconds=12.0)
    )
    assert guard_lines == ledger and {x["unit_price"] for x in guard_lines} == {2.0, 4.0}


def test_an_unpriced_teacher_is_unknown_everywhere_never_zero(tmp_path, artifact_root, capsys):
    """`price: unpriced` against the project's test server: the generations are made, their cost is
    recorded as unknown (no ledger line at $0), and the cost report, its text, the dashboard and the plan
    say "unknown" for every figure that depends on it; so do the summary of a run that stops before
    evaluation (`campaign run`'s other path), `campaign costs` and the dashboard of such a run."""
    from assets import prompts, teacher_generations
    from assets.location import default_resources
    from campaign_orchestrator.costs.dashboard import render_dashboard
    from campaign_orchestrator.costs.ledger import Ledger
    from campaign_orchestrator.costs.plan.render import render_plan
    from campaign_orchestrator.costs.report import build_report, render_text
    from stages.pricing import Pricing

    with ServerThread() as srv:
        path = _campaign(tmp_path, _api("unpriced", base_url=srv.base_url), {}, name="unpriced")
        assert cli.main(["validate", str(path)]) == cli.EXIT_OK
        spec = load_campaign_file(path)
        with DagsterInstance.ephemeral() as instance:
            result = materialize(
                [prompts.build(spec), teacher_generations.build(spec)],
                instance=instance,
                resources=default_resources(str(artifact_root)),
            )
    assert result.success
    (mat,) = result.asset_materializations_for_node("unpriced__teacher_generations")
    md = {k: v.value for k, v in mat.metadata.items()}
    assert md["cost"] == "unknown: teacher.price is `unpriced`"  # one cost, never $0
    assert not {"cost_usd", "spent_this_run_usd", "cache_hits_cost"} & md.keys() and isinstance(md["cache_hits"], int)
    gen = result.asset_value(teacher_generations.build(spec).key)
    assert gen["cost_unknown"] and gen["cost_lines"] == [] and gen["completion_tokens"] > 0
    ledger = Ledger(artifact_root / "cost_ledger.duckdb")
    assert ledger.query("SELECT count(*) AS n FROM cost_lines WHERE asset = 'teacher_generations'")[0]["n"] == 0

    # the run stopped before evaluation: `campaign run`'s summary of what it spent, `campaign costs`, the dashboard
    from campaign_app.cli.run import campaign_summary, print_summary, run_costs

    summary = campaign_summary(
        artifact_root,
        spec.name,
        "cipher",
        run_id=result.run_id,
        spec=spec,
        attempted={"prompts", "teacher_generations"},
    )
    assert summary["spent_this_run_usd"] is None and summary["spent_by_stage"]["teacher_generations"] is None
    capsys.readouterr()
    print_summary(summary, 1.0)
    printed = capsys.readouterr().out
    assert "spent in this run: unknown (teacher_generations unknown: teacher.price is `unpriced`" in printed
    assert "(teacher_generations unknown)" in printed and "spent in this run: $" not in printed
    assert cli.main(["costs", spec.name, "--artifacts", str(artifact_root)]) == cli.EXIT_OK
    listed = capsys.readouterr().out
    assert f"campaign {spec.name}: unknown (teacher_generations unknown" in listed
    run_row = next(x for x in listed.splitlines() if x.strip().startswith(result.run_id))
    assert run_row.split()[3:5] == ["unknown", "unknown"] and "$0.000000 in" not in listed  # spent, teacher
    assert "+ unknown" in render_dashboard(spec.name, ledger)  # no report yet: the ledger says so
    # a run whose unpriced teacher stage failed part-way (no output) spent an unknown amount; one that never
    # reached it spent nothing on it
    assert run_costs(artifact_root, spec, "r-failed", {"prompts", "teacher_generations"})["spent_this_run_usd"] is None
    assert run_costs(artifact_root, spec, "r-early", {"prompts"})["spent_this_run_usd"] == 0.0

    report = build_report(
        campaign=spec.name,
        run_id=result.run_id,
        ledger=ledger,
        primary_suite="cipher",
        manifests={"teacher_generations": gen, "distillation_set": {"key": "d", "rows": 40}},
    )
    for figure in (
        "total_usd",
        "teacher_usd",
        "usd_per_million_teacher_tokens",
        "usd_per_1k_accepted_examples",
        "spent_this_run_usd",
        "campaign_spent_usd",
    ):
        assert report[figure] is None, figure
    assert report["unknown_costs"] == ["teacher: teacher_generations unknown: teacher.price is `unpriced`"]
    text = "\n".join(render_text(report))
    assert "cost of this result: unknown (teacher unknown" in text and "unknown per M teacher tokens" in text
    assert "spent in this run: unknown" in text and "$0.000000 per M" not in text
    ledger.record_report(spec.name, result.run_id, report)
    html = render_dashboard(spec.name, ledger)
    assert "+ unknown" in html and "unpriced: teacher: teacher_generations unknown" in html

    plan = Pricing().plan(spec, artifact_root)
    assert plan.stages["teacher_generations"].usd is None and plan.total_usd is None
    assert "unknown   (teacher_generations: teacher.price is `unpriced`" in render_plan(plan)
