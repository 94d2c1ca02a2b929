"""Every stage runs in plain pytest, without Dagster (issue 44): a shrunk demo campaign (60 prompts, two LoRA steps,
one suite) through ``prompts`` -> ``teacher_generations`` -> ``distillation_set`` -> ``tokenized_dataset`` ->
``student_adapter`` -> ``evaluation`` -> ``promoted_model`` -> ``campaign_cost`` -> ``drift_evaluation``, each
``run(spec, inputs, ctx)`` called with a plain :class:`stages.context.StageContext` (the trainer runs in this process
as a world of one, the launcher a plain function). The teacher stage runs traced (``sys.setprofile``): no call goes
from a lower layer back into a higher one (a frame's layer is the top-level package of its code's file; stdlib and
third-party frames are skipped, so a callback handed down and called from a library is seen too)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from campaigns.loader import load_campaign_file
from stages.context import StageContext
from stages.storage import Store
from tests.support import REPO_ROOT
from tests.support.campaign_support import demo_teacher, write_campaign
from tests.test_layers import layer_rank

pytestmark = pytest.mark.stage

DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Lines:
    """The run's log as a list (a plain :class:`stages.context.Log`)."""

    def __init__(self):
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)

    warning = info


def train_here(job, workdir, budget=None, **_cluster) -> dict:
    """A training launcher without Dagster: the TrainJob in this process as a world of one (its own port), the
    budget checked when it ends."""
    import socket

    from training.recipes import run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in zip(DIST_ENV, ("0", "0", "1", "1", "127.0.0.1", str(port)), strict=True):
            mp.setenv(k, v)
        Path(job.output_dir).mkdir(parents=True, exist_ok=True)
        run(job.write(Path(workdir) / "train_job.json"))
    if budget is not None:
        budget.check()
    return {"logs": []}


# --------------------------------------------------------------------------- the call tracer

_LAYER = layer_rank()


def _layer(filename: str, cache: dict) -> str | None:
    if filename not in cache:
        try:
            rel = Path(filename).resolve().relative_to(REPO_ROOT)
        except ValueError:
            rel = None
        cache[filename] = rel.parts[0] if rel and rel.parts and rel.parts[0] in _LAYER else None
    return cache[filename]


def climbs(fn, *args):
    """Run ``fn`` traced: ``(its result, the calls from a lower layer into a higher one, the layers seen)``, each
    climb as ``caller layer:function -> callee layer:function (file:line)``."""
    cache: dict = {}
    found: list[str] = []
    seen: set[str] = set()

    def profile(frame, event, _arg):
        if event != "call":
            return
        callee = _layer(frame.f_code.co_filename, cache)
        if callee is None:
            return
        seen.add(callee)
        f = frame.f_back
        while f is not None and _layer(f.f_code.co_filename, cache) is None:
            f = f.f_back
        if f is None:
            return
        caller = _layer(f.f_code.co_filename, cache)
        if _LAYER[callee] < _LAYER[caller]:
            code = frame.f_code
            found.append(
                f"{caller}:{f.f_code.co_name} -> {callee}:{code.co_name} "
                f"({Path(code.co_filename).relative_to(REPO_ROOT)}:{code.co_firstlineno})"
            )

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return out, sorted(set(found)), seen


def test_the_tracer_sees_a_call_back_up_through_a_library(tmp_path):
    """A stage handed a callable of the assets layer, called from a third-party frame (a ``map``), is a climb."""
    import assets.common

    def stage_like(values):
        return list(map(assets.common.for_people, values))

    stage_like.__code__ = stage_like.__code__.replace(co_filename=str(REPO_ROOT / "stages" / "fake.py"))
    _out, found, _seen = climbs(stage_like, [{"x_seconds": 1.23}])
    assert found == [
        "stages:stage_like -> assets:for_people (assets/common.py:"
        + str(assets.common.for_people.__code__.co_firstlineno)
        + ")"
    ]


# --------------------------------------------------------------------------- the chain


@pytest.fixture(scope="module")
def chain(tmp_path_factory, demo_models_root):
    """Every stage of the shrunk demo run once, in order: ``(spec, ctx, outcomes, the teacher stage's climbs and
    layers)``."""
    from campaign_orchestrator.demo.recipe import model_dirs
    from stages import (
        campaign_cost,
        distillation_set,
        drift_evaluation,
        evaluation,
        promoted_model,
        prompts,
        student_adapter,
        teacher_generations,
        tokenized_dataset,
    )

    tmp = tmp_path_factory.mktemp("plain")
    root = tmp / "artifacts"
    (root / "models").mkdir(parents=True)
    for src in model_dirs(demo_models_root):
        if (src / "_SUCCESS").exists():
            (root / "models" / src.name).symlink_to(src, target_is_directory=True)
    spec = load_campaign_file(
        write_campaign(tmp / "project", "plain", demo_teacher(), prompts=60, max_steps=2, cost={"budget_usd": 5.0})
    )
    ctx = StageContext(store=Store(root=str(root)), run_id="plain-1", log=Lines(), train=train_here)
    out = {"prompts": prompts.run(spec, {}, ctx)}
    out["teacher_generations"], climbed, layers = climbs(
        teacher_generations.run, spec, {"prompts": out["prompts"].manifest}, ctx
    )
    m = {k: v.manifest for k, v in out.items()}
    out["distillation_set"] = distillation_set.run(
        spec, {"generations": m["teacher_generations"], "prompts": m["prompts"]}, ctx
    )
    out["tokenized_dataset"] = tokenized_dataset.run(spec, {"distillation": out["distillation_set"].manifest}, ctx)
    out["student_adapter"] = student_adapter.run(spec, {"dataset": out["tokenized_dataset"].manifest}, ctx)
    adapter = out["student_adapter"].manifest
    out["evaluation"] = evaluation.run(spec, {"prompts": m["prompts"], "adapter": adapter}, ctx)
    # promotion as after a GO (two steps of training rarely pass the gate: the verdict is the gate's business)
    go = out["evaluation"].manifest | {"verdict": "GO"}
    out["promoted_model"] = promoted_model.run(spec, {"evaluation": go, "adapter": adapter}, ctx)
    manifests = {k: v.manifest for k, v in out.items() if k in campaign_cost.upstream(spec)}
    out["campaign_cost"] = campaign_cost.run(spec, manifests, ctx)
    out["drift_evaluation"] = drift_evaluation.run(spec, {}, ctx)
    return spec, ctx, out, climbed, layers


def test_the_teacher_stage_never_calls_back_up(chain):
    _spec, _ctx, out, climbed, layers = chain
    assert out["teacher_generations"].manifest["stats"]["generated"] > 0  # it generated (traced), not a cache hit
    assert {"stages", "campaign_orchestrator", "campaigns"} <= layers  # the trace saw the layers it went through
    assert "assets" not in layers and "resources" not in layers
    assert climbed == [], "calls from a lower layer back into a higher one:\n" + "\n".join(climbed)


def test_every_stage_ran_and_committed_its_content_keyed_directory(chain):
    spec, ctx, out, _c, _l = chain
    for stage in ("prompts", "teacher_generations", "distillation_set", "tokenized_dataset", "student_adapter"):
        m = out[stage].manifest
        assert not out[stage].cached and Path(m["path"]).name == m["key"], stage
        assert (Path(m["path"]) / "_SUCCESS").exists(), stage
    assert out["prompts"].manifest["train_rows"] + out["prompts"].manifest["heldout_rows"] == 60
    assert out["distillation_set"].manifest["rows"] > 0 and out["tokenized_dataset"].manifest["rows"] > 0
    assert out["student_adapter"].manifest["summary"]["steps"] == 2
    report = out["evaluation"].notes["report"]
    assert report["verdict"] in ("GO", "NO-GO", "INCONCLUSIVE") and out["evaluation"].manifest["candidate_key"]
    assert Path(out["promoted_model"].manifest["adapter_path"], "README.md").exists()  # with its model card
    assert out["campaign_cost"].manifest["key"] == "plain-1" and Path(out["campaign_cost"].manifest["path"]).exists()
    assert out["drift_evaluation"].manifest["report"]["verdict"] in ("DRIFTED", "STABLE", "INCONCLUSIVE")
    ledger = ctx.pricing.ledger_at(ctx.store.root_path())
    assert ledger.spent(spec.name) >= 0.0  # the drift stage recorded its own lines (no IO manager here)


def test_a_stage_run_again_is_found_complete(chain):
    from stages import student_adapter, teacher_generations

    spec, ctx, out, _c, _l = chain
    again = teacher_generations.run(spec, {"prompts": out["prompts"].manifest}, ctx)
    assert again.cached and again.manifest["key"] == out["teacher_generations"].manifest["key"]
    ctx.train = None  # a complete adapter launches nothing
    adapter = student_adapter.run(spec, {"dataset": out["tokenized_dataset"].manifest}, ctx)
    assert adapter.cached and adapter.manifest == out["student_adapter"].manifest


def test_the_promotion_stage_refuses_what_its_evaluation_refuses(chain):
    from stages import promoted_model
    from stages.errors import StageError

    spec, ctx, out, _c, _l = chain
    ev = out["evaluation"].manifest | {"verdict": "NO-GO", "reasons": ["cipher: below the floor"]}
    with pytest.raises(StageError, match="gate verdict for candidate .* is NO-GO"):
        promoted_model.run(spec, {"evaluation": ev, "adapter": out["student_adapter"].manifest}, ctx)
    assert json.loads(Path(out["promoted_model"].manifest["path"], "promotion.json").read_text())["run_id"] == "plain-1"
