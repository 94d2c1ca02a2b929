"""Joining two harness runs per document (no harness process: the worker's result layout, built here)."""

import copy
import shutil

import pytest

from evaluation.harness import HarnessError, agreement_markdown, join_suite


def _entry() -> dict:
    docs = {
        "t_gen": [
            {"doc_id": i, "doc_hash": f"d{i}", "text": f"q{i}", "category": "short" if i % 2 else "long"}
            for i in range(4)
        ]
    }
    prompts = {r: {"t_gen": {str(i): f"p{i}" for i in range(4)}} for r in ("base", "candidate")}

    def run(scores):
        return {
            "seconds": 2.0,
            "aggregates": {"t_gen": sum(scores) / len(scores)},
            "samples": {
                "t_gen": [
                    {
                        "doc_id": i,
                        "doc_hash": f"d{i}",
                        "prompt_hash": f"p{i}",
                        "prompt": f"q{i}",
                        "score": s,
                        "output": "x" if s else "",
                        "reference": "x",
                    }
                    for i, s in enumerate(scores)
                ]
            },
        }

    return {
        "tasks": {"t_gen": {"metric": "exact_match", "filter": "strip", "output_type": "generate_until"}},
        "docs": docs,
        "prompts": prompts,
        "runs": {"base": run([0.0, 1.0, 0.0, 0.0]), "candidate": run([1.0, 1.0, 1.0, 0.0])},
    }


def test_runs_join_on_task_and_doc_id_into_item_results():
    results, agreement = join_suite("s", _entry(), ["base", "candidate"])
    assert [r.item_id for r in results["candidate"]] == ["t_gen/0", "t_gen/1", "t_gen/2", "t_gen/3"]
    assert [r.score for r in results["candidate"]] == [1.0, 1.0, 1.0, 0.0]
    assert [r.category for r in results["base"]] == ["long", "short", "long", "short"]
    assert [(a.role, a.harness, a.project, a.agrees) for a in agreement] == [
        ("base", 0.25, 0.25, True),
        ("candidate", 0.75, 0.75, True),
    ]
    md = agreement_markdown({"agreement": [a.__dict__ | {"agrees": a.agrees} for a in agreement], "seconds": {}})
    assert "| s | t_gen | candidate | exact_match | 4 | 0.7500 | 0.7500 | yes |" in md


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (
            lambda e: e["runs"]["candidate"]["samples"]["t_gen"][2].update(prompt_hash="other"),
            "prompt hash mismatch between base and candidate for 1 of 4 documents (e.g. doc_id 2)",
        ),
        (
            lambda e: e["runs"]["base"]["samples"]["t_gen"][1].update(doc_hash="changed"),
            "the base run scored different documents than the task holds (doc hash mismatch for 1, e.g. doc_id 1)",
        ),
        (
            lambda e: e["runs"]["candidate"]["samples"]["t_gen"].pop(3),
            "the candidate run has 3 documents, the task 4 (missing ['3']",
        ),
        (
            lambda e: e["prompts"]["candidate"]["t_gen"].update({"0": "rendered-otherwise"}),
            "the candidate was asked prompts other than the preflight rendered for 1 documents (e.g. doc_id 0)",
        ),
        (
            lambda e: e["runs"]["base"]["aggregates"].update(t_gen=0.5),
            "the harness's aggregate and the mean of its per-document scores disagree: s/t_gen base: harness 0.5 vs "
            "0.25",
        ),
    ],
)
def test_a_run_that_cannot_be_paired_is_an_error(break_it, expected):
    e = copy.deepcopy(_entry())
    break_it(e)
    with pytest.raises(HarnessError) as err:
        join_suite("s", e, ["base", "candidate"])
    assert expected in str(err.value), str(err.value)


def test_task_directories_are_content_addressed_copies_local_or_s3(tmp_path, s3):
    from evaluation.harness import task_dir
    from tests.support.harness_support import TASKS

    cache = tmp_path / "cache"
    local, sha = task_dir(str(TASKS), tmp_path, cache)
    assert local == cache / sha
    assert (local / "cipher_gen.jsonl").read_bytes() == (TASKS / "cipher_gen.jsonl").read_bytes()
    assert task_dir(str(TASKS), tmp_path, cache) == (local, sha)  # unchanged: the same copy

    s3.create_bucket(Bucket="lm-eval-tasks")  # its own bucket: moto's store is shared by the whole process
    for p in TASKS.iterdir():
        s3.put_object(Bucket="lm-eval-tasks", Key=f"tasks/cipher/{p.name}", Body=p.read_bytes())
    try:
        remote, rsha = task_dir("s3://lm-eval-tasks/tasks/cipher", tmp_path, cache)
        with pytest.raises(HarnessError, match="no objects under s3://lm-eval-tasks/nothing/"):
            task_dir("s3://lm-eval-tasks/nothing", tmp_path, cache)
    finally:
        for p in TASKS.iterdir():
            s3.delete_object(Bucket="lm-eval-tasks", Key=f"tasks/cipher/{p.name}")
        s3.delete_bucket(Bucket="lm-eval-tasks")
    assert rsha == sha and remote == local  # the same content from S3 is the same directory

    edited = tmp_path / "edited"
    shutil.copytree(TASKS, edited)
    (edited / "cipher_gen.jsonl").write_text((TASKS / "cipher_gen.jsonl").read_text().replace("ymdsom", "ymdsoo"))
    other, osha = task_dir(str(edited), tmp_path, cache)
    assert osha != sha and other != local and "ymdsoo" in (other / "cipher_gen.jsonl").read_text()

    with pytest.raises(HarnessError, match="not a directory of task YAML files"):
        task_dir("no/such/dir", tmp_path, cache)
