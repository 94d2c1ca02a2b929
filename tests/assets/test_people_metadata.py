"""What a person reads in the UI: one name per figure (one duration, one cost, one reuse flag), dollars and seconds
with their units, integers as integers, and a reused output saying so (and from which run) instead of showing the
original wall time as this run's."""

from dagster import DagsterInstance, materialize

from assets import prompts
from assets.common import base_metadata, for_people
from assets.io_manager import ledger_metadata
from assets.location import default_resources
from campaigns.loader import resolve_campaign

# names that repeated one figure before (wall_seconds and produced_in_seconds beside time; cost_usd and the spends
# beside cost; cached and ledger_reused beside reused)
REPEATS = {
    "wall_seconds",
    "produced_in_seconds",
    "cost_usd",
    "spent_this_run_usd",
    "ledger_spent_this_run_usd",
    "cached",
    "ledger_reused",
}


def _md(result) -> dict:
    mats = result.asset_materializations_for_node("demo__prompts")
    assert mats
    return {k: v.value for k, v in mats[-1].metadata.items()}


def test_a_materialized_stage_shows_one_time_one_cost_one_reuse_flag_and_what_it_reused(tmp_path):
    spec, _ = resolve_campaign("demo")
    asset = prompts.build(spec)
    with DagsterInstance.ephemeral() as instance:
        first = materialize([asset], resources=default_resources(str(tmp_path)), instance=instance)
        again = materialize([asset], resources=default_resources(str(tmp_path)), instance=instance)
    md = _md(first)
    assert not REPEATS & md.keys(), md.keys()
    took = md["time"]
    assert took.endswith(" s") and float(took.removesuffix(" s")) >= 0 and md["cost"] == "$0" and md["reused"] is False
    assert "reused_from_run" not in md and isinstance(md["train_rows"], int)
    md2 = _md(again)
    assert not REPEATS & md2.keys(), md2.keys()
    assert md2["reused"] is True and md2["reused_from_run"] == first.run_id  # a link to that run's page
    assert md2["time"] == f"reused (took {took} when produced)"  # never as this run's time


def test_the_ledger_says_who_paid_for_a_reused_output():
    """A reused output that cost something says so in its one cost figure: paid in the run that produced it, nothing
    in this one (the ledger's answer overrides the stage's ``cost``)."""
    stage = base_metadata({"path": "/x", "key": "k", "wall_seconds": 14.44, "cost_lines": [{"usd": 0.00092}]}, True)
    assert stage["time"] == "reused (took 14.4 s when produced)"
    assert stage["cost"] == "$0.00092 (paid when produced; nothing in this run)"  # what the stage knows
    ledger = ledger_metadata(
        {"reused": True, "spent_usd": 0.0, "production_usd": 0.00092, "produced_by": "1a2b3c4d-run"}, "this-run"
    )
    assert ledger["reused"] is True and ledger["reused_from_run"].value == "1a2b3c4d-run"
    assert ledger["cost"] == "$0.00092 (paid in run 1a2b3c4d; nothing in this run)"
    paid_here = ledger_metadata(
        {"reused": False, "spent_usd": 0.00092, "production_usd": 0.00092, "produced_by": "this-run"}, "this-run"
    )
    assert paid_here == {"reused": False, "cost": "$0.00092"}  # this run paid
    unpriced = base_metadata({"path": "/x", "key": "k", "cost_lines": [], "cost_unknown": "unknown: unpriced"}, False)
    assert unpriced["cost"] == "unknown: unpriced"  # never $0


def test_for_people_gives_dollars_and_seconds_their_units_and_rounds_the_rest():
    md = for_people(
        {
            "generate_seconds": 21.82805738099978,
            "p95_latency_s": 0.4213,
            "lm_eval_usd": 0.0005164750059162165,
            "tokens_per_s": 1234.5678,
            "cipher_candidate_score": 0.8083333333333333,
            "budget_used_fraction": 0.025712345,
            "tokens": 123456,
            "verdict": "GO",
        }
    )
    assert md == {
        "generate_seconds": "21.8 s",
        "p95_latency_s": "0.4 s",
        "lm_eval_usd": "$0.00052",
        "tokens_per_s": 1234.6,
        "cipher_candidate_score": 0.8083,
        "budget_used_fraction": 0.0257,
        "tokens": 123456,
        "verdict": "GO",
    }
