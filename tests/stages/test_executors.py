"""The stages' KubeRay executor (``stages/executors.py``: ``execution.kuberay``), without Kubernetes or Ray: the
teacher stage and evaluation's answers hand a KubeRay launcher a job file and prompts on the shared volume, and get
back the rows, statistics and shard reports the job's driver wrote, each shard priced on the orchestrator's side. The
launcher here plays the RayJob's driver (tests/resources/test_kuberay_launcher.py and
tests/campaign_orchestrator/generation/scaleout/test_kuberay_stage.py drive the real launcher and the real entry
point)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import yaml

from campaign_orchestrator.dataset.prompts import read_prompt_table
from campaign_orchestrator.generation.requests import Sampling
from campaign_orchestrator.generation.rows import write_generations
from campaign_orchestrator.generation.runner import GenerationStats
from campaign_orchestrator.generation.scaleout.job import Job
from campaign_orchestrator.generation.scaleout.stage import RayRun, ShardReport
from campaigns.loader import parse_campaign_text
from stages.context import StageContext
from stages.executors import KubeRayJob
from stages.storage import Store
from stages.teacher import TeacherModel
from tests.support import REPO_ROOT


class FakeLauncher:
    """``KubeRayJobLauncher.launch``'s contract, the driver's work done in place: the job file is read back as the
    driver reads it, rows go to its output, two shards are reported as ``ray_shard`` messages and in the summary."""

    def __init__(self):
        self.calls: list[tuple[str, dict, Path]] = []

    def launch(self, context, spec, stage, job, workdir, budget=None, on_shard=None):
        self.calls.append((stage, job, Path(workdir)))
        parsed = Job.from_json(json.dumps(job))  # what `python -m campaign_orchestrator.generation.scaleout` would run
        prompts = read_prompt_table(parsed.prompts)
        rows = [
            {
                "id": p["id"],
                "sample_index": 0,
                "prompt": p["prompt"],
                "completion": p["prompt"].upper(),
                "finish_reason": "stop",
                "prompt_tokens": 5,
                "completion_tokens": 3,
                "latency_s": 0.1,
                "from_cache": False,
                "retries": 0,
            }
            for p in prompts
        ]
        write_generations(rows, parsed.output)
        half = len(rows) // 2
        shards = [
            ShardReport(
                "s-one",
                0,
                half,
                generated=half,
                prompt_tokens=5 * half,
                completion_tokens=3 * half,
                seconds=10.0,
                worker="pod-a",
                attempts=1,
            ),
            ShardReport(
                "s-two",
                1,
                len(rows) - half,
                generated=len(rows) - half,
                seconds=20.0,
                prompt_tokens=5 * (len(rows) - half),
                completion_tokens=3 * (len(rows) - half),
                worker="pod-b",
                attempts=1,
            ),
        ]
        run = RayRun(shards=shards, nodes={"10.0.0.1 n1": 1, "10.0.0.2 n2": 1}, wall_s=20.0)
        for i, s in enumerate(shards):
            on_shard(
                {
                    "kind": "ray_shard",
                    "shard": s.id,
                    "generated": s.generated,
                    "failed": 0,
                    "prompt_tokens": s.prompt_tokens,
                    "completion_tokens": s.completion_tokens,
                    "seconds": s.seconds,
                    "final": i == 1,
                }
            )
        stats = GenerationStats(
            prompts=len(rows),
            requests=len(rows),
            distinct_requests=len(rows),
            generated=len(rows),
            prompt_tokens=5 * len(rows),
            completion_tokens=3 * len(rows),
            new_prompt_tokens=5 * len(rows),
            new_completion_tokens=3 * len(rows),
            generate_s=30.0,
            compute_dtype="bfloat16",
        )
        summary = {"stats": stats.as_dict(), "ray": run.as_dict()}
        (Path(workdir) / "ray_summary.json").write_text(json.dumps(summary))
        return {"summary": summary, "ray_job": "ray-cluster-ray-dist-gen-x", "logs": [], "pipes_metadata": {}}


@pytest.fixture
def spec(tmp_path):
    raw = yaml.safe_load((REPO_ROOT / "campaigns/examples/cluster_ray.yaml").read_text())
    raw["kubernetes"]["artifacts"]["mount_path"] = str(tmp_path / "artifacts")
    return parse_campaign_text(yaml.safe_dump(raw), "cluster_ray.yaml")


def test_the_teacher_stage_gets_the_jobs_rows_and_prices_each_shard(spec, tmp_path):
    ctx, launcher = StageContext(store=Store(root=str(tmp_path / "artifacts"))), FakeLauncher()
    rows = [{"id": f"p{i}", "prompt": f"encode w{i} =", "category": "short"} for i in range(6)]
    done: list[int] = []
    workdir = tmp_path / "artifacts" / spec.name / "teacher_generations" / "k1" / "ray"
    executor = KubeRayJob(spec, partial(launcher.launch, None), "teacher_generations", workdir)
    res, lines, ray_md = executor.teacher(
        ctx,
        spec,
        None,
        rows,
        Sampling(max_new_tokens=16),
        TeacherModel(Path("/app/artifacts/models/teacher"), "w1", "vllm:teacher@w1"),
        "teacher_generations",
        log=print,
        progress=done.append,
    )
    ((stage, job, where),) = launcher.calls
    assert (stage, where, job["kind"], job["identity"]) == (
        "teacher_generations",
        workdir,
        "teacher_generations",
        "vllm:teacher@w1",
    )
    assert job["recipe"]["model_path"] == "/app/artifacts/models/teacher" and job["sampling"]["max_new_tokens"] == 16
    assert job["execution"]["kuberay"]["ray_version"] == "2.60.0" and job["cache"]["spool_dir"].startswith(
        str(tmp_path / "artifacts")
    )
    assert [r["completion"] for r in res.rows] == [r["prompt"].upper() for r in rows] and res.stats.generated == 6
    assert done == [3, 3]  # progress from each shard's message
    # each shard priced here with the stage's price (vLLM on h100-sxm: its seconds), tagged with its id
    assert {x["shard"] for x in lines} == {"s-one", "s-two"} and all(x["usd"] > 0 for x in lines)
    by_shard = {s["id"]: s["usd"] for s in ray_md["shards"]}
    assert by_shard["s-two"] == pytest.approx(2 * by_shard["s-one"])  # 20 s against 10 s
    assert (ray_md["shards_total"], ray_md["shards_done"], ray_md["nodes"]) == (
        2,
        2,
        {"10.0.0.1 n1": 1, "10.0.0.2 n2": 1},
    )
    # the rows are the stage's now: the job's prompts and output are removed, its summary stays
    assert sorted(p.name for p in workdir.iterdir()) == ["ray_summary.json"]


def test_evaluation_answers_launch_one_job_per_model_and_length(spec, tmp_path, monkeypatch):
    import stages.answers as ans

    monkeypatch.setattr(ans, "local_quantization_key", lambda q: {"compute_dtype": "cuda:bfloat16"})  # no torch here
    base = tmp_path / "artifacts" / "models" / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    adapter = {"key": "a1", "adapter_path": str(tmp_path / "artifacts" / spec.name / "student_adapter" / "a1")}
    ctx, launcher, dtypes = StageContext(store=Store(root=str(tmp_path / "artifacts"))), FakeLauncher(), {}
    items = tmp_path / "artifacts" / spec.name / "evaluation_items" / "k1" / "ray"
    executor = KubeRayJob(spec, partial(launcher.launch, None), "evaluation", items)
    generate = executor.answerer(ctx, spec, "candidate", base, adapter, dtypes)()
    outs = generate(["encode ab =", "encode cd ="], 16)
    assert [o.text for o in outs] == ["ENCODE AB =", "ENCODE CD ="] and not any(o.error for o in outs)
    ((stage, job, where),) = launcher.calls
    assert (stage, where, job["kind"]) == ("evaluation", items / "candidate@16", "answers")
    assert job["recipe"]["generator"]["model_dir"] == str(base)
    assert job["recipe"]["generator"]["adapter_dir"] == adapter["adapter_path"]
    assert dtypes == {
        "candidate": "bfloat16",
        "_ray": {"candidate@16": "2/2"},
        "_answers": {"candidate": {"generated": 2, "from_cache": 0}},
    }
    with pytest.raises(Exception, match="no KubeRay launcher"):  # a kuberay stage never falls back to a local cluster
        KubeRayJob(spec, None, "evaluation", items).answerer(ctx, spec, "base", base, None, dtypes)()(["x"], 16)


def test_several_teachers_on_kuberay_launch_one_job_each_in_its_own_directory(spec, tmp_path):
    """A teacher per category on KubeRay: the routed teacher stage launches one RayJob per teacher, each with only
    its categories' prompts, its own identity and sampling, its job files under ``ray/<teacher>``; every row and
    every shard's cost line names its teacher."""
    from campaign_orchestrator.demo import cipher
    from stages import prompts, teacher_generations

    data = tmp_path / "prompts.jsonl"
    cipher.write_jsonl(cipher.items(40, seed=1), data)
    raw = spec.model_dump(mode="json", exclude_unset=True)
    one = raw["teacher"]
    raw["teacher"] = [
        one | {"name": "short", "categories": ["short"], "model": "org/short-words", "revision": "r1"},
        one | {"name": "general", "model": "org/general", "revision": "r2"},
    ]
    raw["data"] = raw["data"] | {"source": str(data), "heldout": {"fraction": 0.1, "seed": 0}}
    routed = parse_campaign_text(yaml.safe_dump(raw), "cluster_ray_teachers.yaml")
    launcher, asked = FakeLauncher(), {}

    def launch(spec, stage, job, workdir, budget=None, on_shard=None):  # the prompts each job was given
        asked[Path(workdir).name] = {r["id"] for r in read_prompt_table(job["prompts"])}
        return launcher.launch(None, spec, stage, job, workdir, budget=budget, on_shard=on_shard)

    ctx = StageContext(store=Store(root=str(tmp_path / "artifacts")), kuberay=launch)
    p = prompts.run(routed, {}, ctx).manifest
    m = teacher_generations.run(routed, {"prompts": p}, ctx).manifest

    train = read_prompt_table(p["train_path"])
    short = {r["id"] for r in train if r["category"] == "short"}
    assert 0 < len(short) < len(train)
    by_dir = {where.name: job for _stage, job, where in launcher.calls}
    assert set(by_dir) == {"short", "general"}
    assert all(where.parent == Path(m["path"]) / "ray" for _s, _j, where in launcher.calls)
    assert "org/short-words" in by_dir["short"]["identity"] and "org/general" in by_dir["general"]["identity"]
    assert asked == {"short": short, "general": {r["id"] for r in train} - short}
    rows = read_prompt_table(m["generations_path"])
    assert all(r["teacher"] == ("short" if r["id"] in short else "general") for r in rows)
    assert {(x["teacher"], x["shard"]) for x in m["cost_lines"]} == {
        (t, s) for t in ("short", "general") for s in ("s-one", "s-two")
    }
    assert set(m["ray_teachers"]) == {"short", "general"}
