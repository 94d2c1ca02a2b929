"""What a person reads in the UI: a stage's materialization metadata rounded and with units, and a reused
output saying so (and from which run) instead of showing the original wall time as this run's."""

from dagster import DagsterInstance, materialize

from assets import prompts
from assets.common import for_people
from assets.location import default_resources
from campaigns.loader import resolve_campaign


def _md(result) -> dict:
    mats = result.asset_materializations_for_node("demo__prompts")
    assert mats
    return {k: v.value for k, v in mats[-1].metadata.items()}


def test_a_materialized_stage_shows_rounded_unit_bearing_numbers_and_what_it_reused(tmp_path):
    spec, _ = resolve_campaign("demo")
    asset = prompts.build(spec)
    with DagsterInstance.ephemeral() as instance:
        first = materialize([asset], resources=default_resources(str(tmp_path)), instance=instance)
        again = materialize([asset], resources=default_resources(str(tmp_path)), instance=instance)
    md = _md(first)
    assert md["time"].endswith(" s") and float(md["time"].removesuffix(" s")) == md["wall_seconds"]
    assert md["wall_seconds"] == round(md["wall_seconds"], 1) and md["cost"] == "$0" and md["reused"] is False
    md2 = _md(again)
    assert md2["reused"] is True and md2["reused_from_run"] == first.run_id and md2["cached"] is True
    assert md2["wall_seconds"] == 0.0 and md2["produced_in_seconds"] == md["wall_seconds"]
    assert md2["time"] == f"reused (took {md['time']} when produced)"


def test_for_people_rounds_by_what_the_number_is():
    md = for_people(
        {
            "wall_seconds": 21.82805738099978,
            "cost_usd": 0.0005164750059162165,
            "cipher_candidate_score": 0.8083333333333333,
            "budget_used_fraction": 0.025712345,
            "tokens": 123456,
            "verdict": "GO",
        }
    )
    assert md == {
        "wall_seconds": 21.8,
        "cost_usd": 0.0005165,
        "cipher_candidate_score": 0.8083,
        "budget_used_fraction": 0.0257,
        "tokens": 123456,
        "verdict": "GO",
    }
