"""The serving path: the same suite scored through a real OpenAI-compatible HTTP server that
answers with the demo models (teacher as the candidate, student base as the base)."""

import pytest

from evaluation.endpoint import OpenAIEndpoint
from evaluation.gate import GO, GatePolicy, StatsPolicy
from evaluation.runner import SuiteGate, SuiteRun, answer_suites, judge
from evaluation.scorers import build_scorer
from evaluation.suite import load_items
from tests.support.eval_support import ModelServer, heldout_rows, make_zero_adapter


@pytest.fixture(scope="module")
def server(demo_models, tmp_path_factory):
    with ModelServer(
        {"teacher": demo_models["teacher"], "student": demo_models["student"]},
        lora_base=demo_models["student"],
        hang_s=30.0,
    ) as s:
        yield s


def by_role(rows):
    from evaluation.gate import ItemResult

    out = {}
    for r in rows:
        out.setdefault(r["model"], {}).setdefault(r["suite"], []).append(
            ItemResult(r["item_id"], r["category"], r["output"], r["score"], r["latency_s"], r["error"])
        )
    return out


@pytest.mark.stage
def test_suite_scored_through_the_endpoint_with_errors_recorded(server):
    rows = heldout_rows(16)
    items = load_items("heldout", rows, ".")
    items += [
        {"id": "crash", "prompt": "encode CRASH =", "reference": "x", "category": "short"},
        {"id": "hang", "prompt": "encode HANG =", "reference": "x", "category": "short"},
    ]
    ep = lambda name: lambda: OpenAIEndpoint(server.base_url, name, max_concurrency=3, timeout_s=4.0).generate  # noqa: E731
    suite = SuiteRun("cipher", items, build_scorer("exact_match"), 12)
    out = answer_suites([suite], {"candidate": ep("teacher"), "base": ep("student")}, log=lambda m: None)
    errors = {(r["model"], r["item_id"]): r["error"] for r in out if r["error"]}
    assert errors[("candidate", "crash")].startswith("HTTP 500")
    assert errors[("candidate", "hang")] == "timeout after 4 s"
    assert len(errors) == 4  # both models, the two faulty items: errors, never wrong answers
    assert all(r["score"] is None for r in out if r["error"])
    assert 1 < server.max_in_flight <= 3  # bounded concurrency, really concurrent

    res = by_role(out)
    report = judge(
        res, [SuiteGate("cipher", GatePolicy(min_score=0.8, min_items=12, max_error_rate=0.15), True)], StatsPolicy()
    )[0]
    assert report.candidate.score == 1.0 and report.base.score == 0.0  # the teacher knows the cipher; the base copies
    assert report.candidate.errors == 2 and report.overall.n == 16
    assert report.verdict == GO
    strict = judge(
        res, [SuiteGate("cipher", GatePolicy(min_score=0.8, min_items=12, max_error_rate=0.05), True)], StatsPolicy()
    )[0]
    assert strict.verdict == "INCONCLUSIVE"  # 2 of 18 errored: too many to decide, and not a NO-GO


def test_unknown_model_and_adapter_loading(server, demo_models, tmp_path):
    missing = OpenAIEndpoint(server.base_url, "nope", timeout_s=5).generate(["encode abc ="], 4)
    assert missing[0].error.startswith("HTTP 404")
    adapter = make_zero_adapter(demo_models["student"], tmp_path / "adapter")
    ep = OpenAIEndpoint(server.base_url, "cand-1", timeout_s=30)
    ep.load_adapter("cand-1", str(adapter))
    ep.load_adapter("cand-1", str(adapter))  # already loaded: accepted
    base = OpenAIEndpoint(server.base_url, "student", timeout_s=30).generate(["encode abc ="], 6)
    served = ep.generate(["encode abc ="], 6)
    assert served[0].error is None and served[0].text == base[0].text  # a zero adapter answers like its base
    with pytest.raises(RuntimeError, match="refused adapter"):
        ep.load_adapter("cand-2", str(tmp_path / "no-adapter"))


def test_api_key_comes_from_the_environment_and_is_never_shown(monkeypatch):
    monkeypatch.setenv("EVAL_TEST_KEY", "sk-secret-value")
    ep = OpenAIEndpoint("http://127.0.0.1:9/v1", "m", api_key_env="EVAL_TEST_KEY")
    assert "sk-secret" not in repr(ep)
    out = ep.generate(["x"], 1)  # nothing listens on port 9: a connection error, recorded
    assert out[0].error and "sk-secret" not in out[0].error
    monkeypatch.delenv("EVAL_TEST_KEY")
    with pytest.raises(ValueError, match="EVAL_TEST_KEY"):
        OpenAIEndpoint("http://127.0.0.1:9/v1", "m", api_key_env="EVAL_TEST_KEY")


def test_evaluation_asset_scores_the_served_candidate(server, demo_models, artifact_root, tmp_path):
    """backend: openai through Dagster: the asset loads this candidate's adapter into the server
    (as vLLM's runtime LoRA loading does) and gates what the server answers."""
    import yaml
    from dagster import DagsterInstance, materialize

    from assets import demo_models as demo_models_asset
    from assets.common import key
    from assets.location import campaign_assets, default_resources
    from campaigns.loader import load_campaign_file
    from tests.support.eval_support import REPO_ROOT, seed_upstream

    d = yaml.safe_load((REPO_ROOT / "campaigns/demo.yaml").read_text())
    d["name"] = "served"
    d["evaluation"] = {
        "suites": [{"name": "cipher", "source": "heldout", "max_new_tokens": 8}],
        "gate": {"min_score": 0.0, "min_items": 12},
        "statistics": {"resamples": 1000},
        "backend": "openai",
        "evaluate_teacher": False,
        "endpoint": {
            "base_url": server.base_url,
            "base_model": "student",
            "load_adapter": True,
            "max_concurrency": 4,
            "timeout_s": 30,
        },
    }
    (tmp_path / "served.yaml").write_text(yaml.safe_dump(d, allow_unicode=True))
    spec = load_campaign_file(tmp_path / "served.yaml")
    adapter = make_zero_adapter(demo_models["student"], tmp_path / "adapter")
    cand = seed_upstream(artifact_root, "served", heldout_rows(12), adapter, demo_models["student"])
    result = materialize(
        campaign_assets(spec) + [demo_models_asset.demo_models],
        selection=[key(spec, "evaluation")],
        resources=default_resources(str(artifact_root)),
        instance=DagsterInstance.ephemeral(),
    )
    assert result.success
    assert server.loaded[f"served-{cand['key']}"] == str(adapter)  # the exact candidate was served
    check = result.get_asset_check_evaluations()[0]
    assert check.passed and check.metadata["verdict"].value == "GO"
    assert "candidate − base +0.0 pts [+0.0, +0.0]" in check.metadata["cipher"].value  # B = 0: the base's answers


@pytest.mark.stage
def test_a_fixed_served_name_is_credited_only_when_it_serves_this_candidate(
    server, demo_models, artifact_root, tmp_path
):
    """`candidate_model: NAME` (the server started with `--lora-modules NAME=PATH`): the evaluation checks,
    through /v1/models, that NAME is this candidate's adapter, byte for byte, before crediting its score;
    another adapter under that name fails the evaluation with the reason."""
    import shutil

    import yaml
    from dagster import DagsterInstance, materialize

    from assets import demo_models as demo_models_asset
    from assets.common import key
    from assets.location import campaign_assets, default_resources
    from campaigns.loader import load_campaign_file
    from tests.support.eval_support import REPO_ROOT, seed_upstream

    served = make_zero_adapter(demo_models["student"], tmp_path / "served", r=4)
    assert server.load_lora("fixed-cand", str(served))[0] == 200  # what --lora-modules fixed-cand=PATH does
    d = yaml.safe_load((REPO_ROOT / "campaigns/demo.yaml").read_text())
    d["name"] = "fixed"
    d["evaluation"] = {
        "suites": [{"name": "cipher", "source": "heldout", "max_new_tokens": 8}],
        "gate": {"min_score": 0.0, "min_items": 12},
        "statistics": {"resamples": 500},
        "backend": "openai",
        "score_teacher": False,
        "endpoint": {
            "base_url": server.base_url,
            "base_model": "student",
            "candidate_model": "fixed-cand",
            "max_concurrency": 4,
            "timeout_s": 30,
        },
    }
    (tmp_path / "fixed.yaml").write_text(yaml.safe_dump(d, allow_unicode=True))
    spec = load_campaign_file(tmp_path / "fixed.yaml")

    def evaluate(adapter_dir):
        seed_upstream(artifact_root, "fixed", heldout_rows(12), adapter_dir, demo_models["student"])
        return materialize(
            campaign_assets(spec) + [demo_models_asset.demo_models],
            selection=[key(spec, "evaluation")],
            resources=default_resources(str(artifact_root)),
            instance=DagsterInstance.ephemeral(),
            raise_on_error=False,
        )

    same = shutil.copytree(served, tmp_path / "candidate-same")  # the candidate's own copy of the served bytes
    assert evaluate(same).success
    other = make_zero_adapter(demo_models["student"], tmp_path / "candidate-other", r=8)
    result = evaluate(other)
    assert not result.success
    msg = " ".join(e.event_specific_data.error.message for e in result.all_events if e.is_step_failure)
    assert f"serves 'fixed-cand' from {served}" in msg and f"not the candidate's adapter {other}" in msg
    assert not result.get_asset_check_evaluations()  # no verdict credited to it


@pytest.mark.stage
def test_drift_scores_the_promoted_adapter_through_the_endpoint(server, demo_models, artifact_root, tmp_path):
    """With `evaluation.backend: openai`, the drift check answers through the same endpoint as the
    evaluation: it loads the promoted adapter onto the server (under its promoted key) and scores what the
    server answers; promotion-time scores come from the same server."""
    import json
    import time

    import yaml
    from dagster import DagsterInstance

    from assets.location import build_definitions
    from campaign_orchestrator.demo import cipher
    from evaluation.drift import PROMOTION_ITEMS
    from evaluation.scorers import build_scorer
    from evaluation.suite import run_suite, write_item_rows
    from tests.support.eval_support import REPO_ROOT

    d = yaml.safe_load((REPO_ROOT / "campaigns/demo.yaml").read_text())
    d["name"] = "servedrift"
    cipher.write_jsonl(cipher.items(80, seed=5), tmp_path / "drops" / "a.jsonl")
    d["data"]["source"] = str(tmp_path / "drops" / "*.jsonl")
    d["data"]["heldout"] = {"fraction": 0.25, "seed": 0}
    d["evaluation"] = {
        "suites": [{"name": "cipher", "source": "heldout", "max_new_tokens": 8}],
        "gate": {"min_score": 0.0, "min_items": 12},
        "backend": "openai",
        "score_teacher": False,
        "endpoint": {
            "base_url": server.base_url,
            "base_model": "student",
            "load_adapter": True,
            "max_concurrency": 4,
            "timeout_s": 30,
        },
    }
    d["automation"] = {"drift": {"max_drop": 0.1}}
    (tmp_path / "servedrift.yaml").write_text(yaml.safe_dump(d))

    key = "zero0000000000000000"
    dest = artifact_root / "servedrift" / "promoted_model" / key
    make_zero_adapter(demo_models["student"], dest / "adapter")
    OpenAIEndpoint(server.base_url, "x").load_adapter(f"promo-{key}", str(dest / "adapter"))
    promo = [
        {"id": f"h{i}", "prompt": r["prompt"], "reference": r["reference"], "category": "all"}
        for i, r in enumerate(heldout_rows(40)[20:])
    ]
    _, rows = run_suite(
        "cipher",
        "candidate",
        promo,
        OpenAIEndpoint(server.base_url, f"promo-{key}").generate,
        build_scorer("exact_match"),
        8,
    )
    write_item_rows(rows, dest / PROMOTION_ITEMS)
    (dest / "promotion.json").write_text(
        json.dumps(
            {
                "candidate_key": key,
                "base_model_path": str(demo_models["student"]),
                "verdict": "GO",
                "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "items": PROMOTION_ITEMS,
                "scores": {"candidate": {"cipher": 0.0}},
            }
        )
    )
    (dest.parent / "CURRENT").write_text(key)

    defs = build_definitions([str(tmp_path / "servedrift.yaml")], artifact_root=str(artifact_root))
    result = defs.resolve_job_def("servedrift_drift_check").execute_in_process(instance=DagsterInstance.ephemeral())
    (mat,) = result.asset_materializations_for_node("servedrift__drift_evaluation")
    md = {k: v.value for k, v in mat.metadata.items()}
    assert server.loaded[f"servedrift-{key}"] == str(dest / "adapter") and md["backend"] == "openai"
    assert md["verdict"] == "STABLE" and md["heldout_items"] >= 12  # judged on what the server answered
    assert md["cipher_promoted_score"] == 0.0 and md["cipher_fresh_score"] == 0.0  # a zero adapter copies words
