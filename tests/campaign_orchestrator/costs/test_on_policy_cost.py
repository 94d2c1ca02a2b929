"""On-policy distillation's cost (issue 26): the teacher's prefills of the student's samples are billed per round
through the one door (Pricing.bill, "on_policy_scoring") at an API teacher's input price, land in the
ledger as teacher lines, are watched by the training guard beside the training time, and are planned."""

from __future__ import annotations

import pytest
import yaml

from campaign_orchestrator.costs.budget import BudgetExceeded, BudgetGuard, Limit
from campaign_orchestrator.costs.catalog import read_catalog, stage_bill
from campaign_orchestrator.costs.ledger import Ledger
from campaigns.loader import parse_campaign_text
from tests.support import REPO_ROOT

CATALOG = REPO_ROOT / "campaigns" / "pricing" / "catalog.yaml"
ROUNDS = [
    {"round": 0, "samples": 16, "teacher_prefill_tokens": 2400},
    {"round": 1, "samples": 16, "teacher_prefill_tokens": 2600, "teacher_completion_tokens": 16},
]


def on_policy_spec(api: bool = True, price: str = "api-open-70b", batch: bool = False):
    """campaigns/smollm2_on_policy.yaml, its teacher behind an endpoint (api) or in process (as shipped)."""
    data = yaml.safe_load((REPO_ROOT / "campaigns" / "smollm2_on_policy.yaml").read_text())
    if api:
        data["teacher"] = {"backend": "openai", "model": "teacher", "base_url": "http://127.0.0.1:9/v1", "price": price}
        data["training"]["distillation"]["teacher_tokenizer"] = "."
    data.setdefault("cost", {})["teacher_batch_api"] = batch
    if price == "unpriced":
        data["cost"].pop("budget_usd", None)  # no budget can cover an unknown spend (the spec refuses it)
    spec = parse_campaign_text(yaml.safe_dump(data), str(REPO_ROOT / "campaigns" / "smollm2_on_policy.yaml"))
    spec.set_project_dir(REPO_ROOT)
    return spec


@pytest.fixture(scope="module")
def catalog():
    return read_catalog(CATALOG)


def test_api_teacher_prefills_are_billed_per_round_at_the_input_price(catalog):
    from stages.pricing import Pricing

    spec = on_policy_spec()
    in_usd, out_usd = catalog.get("api-open-70b").token_usd()
    bill = Pricing().bill(spec, "on_policy_scoring", {"rounds": ROUNDS})
    lines = bill["lines"]
    assert [(x["round"], x["price_key"], x["kind"]) for x in lines] == [
        (0, "api-open-70b:input", "teacher"),
        (1, "api-open-70b:input", "teacher"),
        (1, "api-open-70b:output", "teacher"),
    ]
    assert [x["quantity"] for x in lines] == pytest.approx([2400 / 1e6, 2600 / 1e6, 16 / 1e6])
    assert bill["usd"] == pytest.approx((2400 + 2600) / 1e6 * in_usd + 16 / 1e6 * out_usd)
    assert bill["parts_usd"] == pytest.approx(
        {"round 0": 2400 / 1e6 * in_usd, "round 1": 2600 / 1e6 * in_usd + 16 / 1e6 * out_usd}
    )
    # the campaign's batch price applies, and a total without rounds prices the same tokens
    batch = stage_bill(
        on_policy_spec(batch=True), catalog, "on_policy_scoring", {"prompt_tokens": 5000, "completion_tokens": 16}
    )
    assert batch["usd"] == pytest.approx(bill["usd"] * 0.5)


def test_the_lines_reach_the_ledger_as_teacher_spend_of_the_training_stage(tmp_path, catalog):
    spec = on_policy_spec()
    scoring = stage_bill(spec, catalog, "on_policy_scoring", {"rounds": ROUNDS})
    training = stage_bill(spec, catalog, "student_adapter", {"seconds": 360.0, "device": "cpu"})
    ledger = Ledger(tmp_path / "ledger.duckdb")
    manifest = {"key": "k1", "production_id": "p1", "cost_lines": training["lines"] + scoring["lines"]}
    rec = ledger.record_stage(campaign=spec.name, asset="student_adapter", run_id="r1", step_key="s", manifest=manifest)
    assert rec["spent_usd"] == pytest.approx(training["usd"] + scoring["usd"])
    by_kind = {
        row["kind"]: row["usd"] for row in ledger.query("SELECT kind, SUM(usd) AS usd FROM cost_lines GROUP BY kind")
    }
    assert by_kind == pytest.approx({"training": training["usd"], "teacher": scoring["usd"]})
    assert len(ledger.lines(spec.name)) == 1 + 3  # one training line, one teacher line per round (and its output)


def test_an_in_process_teacher_has_no_line_of_its_own_and_unpriced_is_unknown(catalog):
    bill = stage_bill(on_policy_spec(api=False), catalog, "on_policy_scoring", {"rounds": ROUNDS})
    assert bill["lines"] == [] and bill["usd"] == 0.0 and "in process" in bill["billing_note"]
    unpriced = stage_bill(on_policy_spec(price="unpriced"), catalog, "on_policy_scoring", {"rounds": ROUNDS})
    assert unpriced["lines"] is None and unpriced["usd"] is None  # unknown, never $0


def test_the_training_guard_counts_time_and_the_rounds_teacher_prefills(tmp_path, catalog):
    """A timed guard that is also metered: the rounds' prefills charged as they finish stop training when the
    next round would cross the budget, and the stop records both kinds of spend as interrupted."""
    from stages.pricing import _line_fn, _on_policy_meter, charge_round

    spec = on_policy_spec()
    now = [0.0]
    ledger = Ledger(tmp_path / "ledger.duckdb")
    guard = BudgetGuard(
        ledger=ledger,
        campaign=spec.name,
        stage="student_adapter",
        run_id="r",
        step_key="s",
        attempt=0,
        stage_key="k",
        limits=[Limit("campaign x", 0.02, 0.0)],
        line_fn=_line_fn(spec, "student_adapter", catalog, {}),
        metered=_on_policy_meter(spec, catalog),
        clock=lambda: now[0],
        log=lambda _m: None,
    )
    in_usd = catalog.get("api-open-70b").token_usd()[0]
    now[0] = 36.0
    charge_round(guard, {"round": 0, "samples": 16, "teacher_prefill_tokens": 5000})
    kinds = [x["kind"] for x in guard.accrued_lines()]
    training = stage_bill(spec, catalog, "student_adapter", {"seconds": 36.0})["usd"]
    assert kinds == ["training", "teacher"]
    assert guard.accrued_usd() == pytest.approx(training + 5000 / 1e6 * in_usd)
    with pytest.raises(BudgetExceeded, match="stopped student_adapter mid-way"):
        guard.charge(prompt_tokens=9000, items=16)  # a round this size again would cross $0.02
    recorded = ledger.query("SELECT kind, status, SUM(usd) AS usd FROM cost_lines GROUP BY kind, status ORDER BY kind")
    assert [(r["kind"], r["status"]) for r in recorded] == [("teacher", "interrupted"), ("training", "interrupted")]
    assert recorded[0]["usd"] == pytest.approx(14000 / 1e6 * in_usd)


def test_the_plan_of_an_on_policy_campaign(demo_models):
    """`campaign plan` on a fully on-policy campaign: no teacher stage; student_adapter's estimate holds the
    student's sampling time and the teacher's prefill tokens, priced at the API's input price (an API teacher)
    or as training-host time (in process)."""
    from campaign_orchestrator.costs.plan.render import render_plan
    from campaign_orchestrator.costs.plan.stages import plan_on_policy
    from stages.pricing import Pricing

    specs = {}
    for api in (True, False):
        data = yaml.safe_load((REPO_ROOT / "campaigns" / "demo.yaml").read_text())
        if api:
            data["teacher"] = {
                "backend": "openai",
                "model": "teacher",
                "base_url": "http://127.0.0.1:9/v1",
                "price": "api-open-70b",
            }
        data["student"]["quantization"]["load_in_4bit"] = False
        data["training"]["distillation"] = {
            "loss": "on_policy",
            "teacher_tokenizer": str(demo_models["teacher"]),
            "on_policy": {"samples_per_round": 24, "max_new_tokens": 16, "teacher_generations": "none"},
        }
        data["training"]["max_steps"] = 10
        data["data"].pop("decontamination", None)
        data["data"].pop("filters", None)
        specs[api] = parse_campaign_text(yaml.safe_dump(data), str(REPO_ROOT / "campaigns" / "demo.yaml"))
        specs[api].set_project_dir(REPO_ROOT)
    plan = Pricing().plan(specs[True], demo_models["student"].parents[1].parent)
    assert "teacher_generations" not in plan.stages
    sa = plan.stages["student_adapter"]
    op = sa.on_policy
    assert op.samples == 10 * 12 and op.rounds == 5 and op.sampling_seconds > 0
    assert op.teacher_prefill_tokens > op.samples
    assert "on-policy: 5 rounds, 120 student samples" in render_plan(plan)
    catalog = read_catalog(CATALOG)
    in_usd, out_usd = catalog.get("api-open-70b").token_usd()
    assert op.teacher_usd == pytest.approx(round(op.teacher_prefill_tokens) / 1e6 * in_usd + 120 / 1e6 * out_usd)
    assert sa.usd == pytest.approx(op.training_host_usd + op.teacher_usd)
    # the teacher in process: the same samples and tokens, no teacher dollars, its prefills as training-host time
    student = plan.student
    local = plan_on_policy(
        specs[False], catalog, plan.data, student, student, catalog.get("cpu-2vcpu"), 10, 12, sa.compute_dtype
    )
    assert (local.samples, local.teacher_prefill_tokens) == (op.samples, op.teacher_prefill_tokens)
    assert local.teacher_usd == 0.0 and local.scoring_seconds_in_process > 0


def test_launchers_charge_each_finished_round_as_its_message_arrives(tmp_path, catalog):
    """The launchers hand every `on_policy_round` Pipes message to the guard while training runs (local: the
    observe loop picks them with `round_messages`; Kubernetes: `_stream_metrics`), so an API teacher's prefills
    stop training mid-way when the budget is crossed, not only when the run is billed at its end."""
    from types import SimpleNamespace

    from resources.k8s.launcher import K8sTrainingLauncher
    from resources.local_launcher import round_messages
    from stages.pricing import _line_fn, _on_policy_meter

    spec = on_policy_spec()
    guard = BudgetGuard(
        ledger=Ledger(tmp_path / "ledger.duckdb"),
        campaign=spec.name,
        stage="student_adapter",
        run_id="r",
        step_key="s",
        attempt=0,
        stage_key="k",
        limits=[Limit("campaign x", 0.02, 0.0)],
        line_fn=_line_fn(spec, "student_adapter", catalog, {}),
        metered=_on_policy_meter(spec, catalog),
        clock=lambda: 0.0,
        log=lambda _m: None,
    )
    msgs = [
        {"kind": "train_metrics", "step": 1, "loss": 1.0},
        {"kind": "on_policy_round", "round": 0, "samples": 16, "teacher_prefill_tokens": 5000},
    ]
    assert round_messages(msgs, 0) == [msgs[1]] and round_messages(msgs, 2) == []
    session = SimpleNamespace(get_custom_messages=lambda: msgs)
    context = SimpleNamespace(has_assets_def=False)
    assert K8sTrainingLauncher._stream_metrics(context, session, 0, guard) == 2
    in_usd = catalog.get("api-open-70b").token_usd()[0]
    assert guard.accrued_usd() == pytest.approx(5000 / 1e6 * in_usd)
    msgs.append({"kind": "on_policy_round", "round": 1, "samples": 16, "teacher_prefill_tokens": 90000})
    with pytest.raises(BudgetExceeded, match="stopped student_adapter mid-way"):
        K8sTrainingLauncher._stream_metrics(context, session, 2, guard)
