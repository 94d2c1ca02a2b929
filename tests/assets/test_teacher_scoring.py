"""The teacher is scored on the held-out items whatever its backend: here an endpoint (the project's
test server, which answers the cipher), through the teacher's generation cache and at its price; the
metadata, the cost report and the CLI summary show student ÷ teacher."""

from __future__ import annotations

import pytest
import yaml
from dagster import DagsterInstance, materialize

from tests.support.eval_support import REPO_ROOT, heldout_rows, make_zero_adapter, seed_upstream
from tests.support.testserver import ServerThread

pytestmark = pytest.mark.stage


def _spec(tmp_path, base_url: str | None, **evaluation):
    from campaigns.loader import load_campaign_file

    d = yaml.safe_load((REPO_ROOT / "campaigns/demo.yaml").read_text())
    d["name"] = "scored"
    d["teacher"] = (
        {
            "backend": "openai",
            "model": "teacher",
            "base_url": base_url,
            "price": "api-open-70b",
            "max_concurrency": 4,
            "sampling": {"max_new_tokens": 16},
        }
        if base_url
        else {
            # the student's own base weights as teacher (context distillation asks its bare prompts like this)
            "backend": "transformers",
            "model": "@demo/student",
            "compute_dtype": "float32",
            "hardware": "cpu-2vcpu",
            "sampling": {"max_new_tokens": 16},
        }
    )
    d["student"]["quantization"] = {"load_in_4bit": False, "compute_dtype": "float32"}
    d["evaluation"] = {
        "suites": [{"name": "cipher", "max_new_tokens": 16}],
        "gate": {"min_score": 0.0, "min_items": 12, "max_category_regression": None},
        "statistics": {"resamples": 500},
        **evaluation,
    }
    d.pop("schedule", None)
    (tmp_path / "scored.yaml").write_text(yaml.safe_dump(d))
    return load_campaign_file(tmp_path / "scored.yaml")


def _evaluate(spec, root):
    from assets import demo_models
    from assets.common import key
    from assets.location import campaign_assets, default_resources

    result = materialize(
        campaign_assets(spec) + [demo_models.demo_models],
        selection=[key(spec, "evaluation")],
        resources=default_resources(str(root)),
        instance=DagsterInstance.ephemeral(),
    )
    assert result.success
    (mat,) = result.asset_materializations_for_node("scored__evaluation")
    return {k: v.value for k, v in mat.metadata.items()}, result.asset_value(key(spec, "evaluation"))


def test_an_endpoint_teacher_is_scored_priced_and_cached(tmp_path, artifact_root, demo_models):
    rows = heldout_rows(24)
    with ServerThread() as srv:
        spec = _spec(tmp_path, srv.base_url)
        seed_upstream(
            artifact_root,
            "scored",
            rows,
            make_zero_adapter(demo_models["student"], tmp_path / "a", r=4),
            demo_models["student"],
        )
        md, manifest = _evaluate(spec, artifact_root)
        asked = srv.stats.received
        # the teacher answers the cipher; the untrained candidate copies words: student ÷ teacher = 0
        assert md["cipher_teacher_score"] == 1.0 and md["cipher_candidate_score"] == 0.0
        assert md["cipher_student_teacher_ratio"] == 0.0
        assert asked == len({r["prompt"] for r in rows})  # every held-out prompt once
        teacher_lines = [x for x in manifest["cost_lines"] if x["price_key"].startswith("api-open-70b")]
        assert {x["kind"] for x in teacher_lines} == {"evaluation"} and sum(x["usd"] for x in teacher_lines) > 0

        # another candidate: the teacher's answers come from the generation cache, not paid for again
        seed_upstream(
            artifact_root,
            "scored",
            rows,
            make_zero_adapter(demo_models["student"], tmp_path / "b", r=8),
            demo_models["student"],
        )
        md2, manifest2 = _evaluate(spec, artifact_root)
        assert md2["cipher_teacher_score"] == 1.0 and srv.stats.received == asked
        assert not [x for x in manifest2["cost_lines"] if x["price_key"].startswith("api-open-70b")]

        # score_teacher: false skips it
        off = _spec(tmp_path, srv.base_url, score_teacher=False)
        md3, _ = _evaluate(off, artifact_root)
        assert "cipher_teacher_score" not in md3 and srv.stats.received == asked


def test_a_teacher_over_the_base_weights_takes_the_base_answers_and_the_base_is_answered_once(
    tmp_path, artifact_root, demo_models
):
    """Local answers are cached under the model's content identity: the base's are a transformers teacher's over
    the same weights and dtype (context distillation's bare prompts), so that teacher is never asked again, and a
    second candidate's evaluation takes the base's answers from the cache."""
    from evaluation.suite import read_item_results

    rows = heldout_rows(24)
    n = len({r["prompt"] for r in rows})
    spec = _spec(tmp_path, None)
    seed_upstream(
        artifact_root,
        "scored",
        rows,
        make_zero_adapter(demo_models["student"], tmp_path / "a", r=4),
        demo_models["student"],
    )
    md, manifest = _evaluate(spec, artifact_root)
    assert md["answers"] == {
        "candidate": {"generated": n, "from_cache": 0},
        "base": {"generated": n, "from_cache": 0},
        "teacher": {"generated": 0, "from_cache": n},
    }
    res = read_item_results(manifest["items_path"])
    assert [x.output for x in res["teacher"]["cipher"]] == [x.output for x in res["base"]["cipher"]]
    # the zero adapter answers like the base, but it is another model: generated under its own identity
    assert [x.output for x in res["candidate"]["cipher"]] == [x.output for x in res["base"]["cipher"]]

    seed_upstream(
        artifact_root,
        "scored",
        rows,
        make_zero_adapter(demo_models["student"], tmp_path / "b", r=8),
        demo_models["student"],
    )
    md2, _ = _evaluate(spec, artifact_root)
    assert md2["answers"] == {
        "candidate": {"generated": n, "from_cache": 0},
        "base": {"generated": 0, "from_cache": n},
        "teacher": {"generated": 0, "from_cache": n},
    }
    assert md2["cipher_base_score"] == md["cipher_base_score"]


def test_the_summary_prints_the_scorer_and_student_over_teacher(capsys):
    from campaign_app.cli.run import print_summary

    print_summary(
        {
            "campaign": "c",
            "suite": "qa",
            "scorer": "contains_answer",
            "teacher": 0.8,
            "base": 0.2,
            "candidate": 0.6,
            "student_teacher_ratio": 0.75,
            "verdict": "GO",
            "reasons": [],
        },
        1.0,
    )
    out = capsys.readouterr().out
    assert "teacher   qa (contains_answer): 80.0%" in out and "student   qa (contains_answer): 60.0%" in out
    assert "student ÷ teacher: 75.0%" in out and "exact match" not in out
