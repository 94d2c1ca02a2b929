"""Cross-tokenizer logit distillation end to end through Dagster.

- An API teacher (the project's teacher server on the demo teacher, over HTTP) returns its top-k as token text:
  logit distillation from it trains (before, its rows had no token ids and the dataset stage refused them after
  the teacher was paid); with the student's own tokenizer every position is exact.
- ``heavy``: the shipped ``campaigns/demo_xtok.yaml`` (the byte-level BPE teacher and the character-level
  student) reaches GO, with at least 20% of the label positions through the vocabulary-free part; and the same
  BPE teacher behind the HTTP server aligns the same way from its token text.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from dagster import AssetKey, DagsterInstance

from assets.location import build_definitions, campaign_job_name
from campaign_orchestrator.demo import cipher
from tests.support import REPO_ROOT as REPO

pytestmark = pytest.mark.slow

TRAIN_STAGES = ("prompts", "teacher_generations", "distillation_set", "tokenized_dataset", "student_adapter")


def _metadata(result, key: AssetKey) -> dict:
    mats = result.asset_materializations_for_node(key.to_python_identifier())
    assert mats, f"no materialization of {key.to_user_string()}"
    return {k: v.value for k, v in mats[-1].metadata.items()}


@contextmanager
def teacher_server(model_dir: Path, name: str):
    """The project's teacher server (OpenAI completions with top-k log-probabilities) on ``model_dir``, in a
    thread; yields its base URL."""
    import uvicorn

    from campaign_orchestrator.generation.local import LocalModel
    from campaign_orchestrator.teacher.server import TeacherServer, build_app

    gen = LocalModel.from_path(model_dir, compute_dtype="float32", batch_size=16)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(TeacherServer(gen, name)), log_level="warning", access_log=False))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and th.is_alive(), "the teacher server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        th.join(10)


def _api_campaign(tmp_path: Path, name: str, url: str, served: str, items: int, steps: int) -> Path:
    spec = yaml.safe_load((REPO / "campaigns" / "demo_xtok.yaml").read_text())
    data = tmp_path / "prompts.jsonl"
    cipher.write_jsonl(cipher.items(items, seed=5), data)
    spec["name"] = name
    spec.pop("schedule", None)
    spec["teacher"] = {
        "backend": "openai",
        "base_url": url,
        "model": served,
        "price": "api-open-70b",
        "max_concurrency": 4,
        "sampling": {"temperature": 0.0, "max_new_tokens": 16, "logprobs": 4},
    }
    spec["data"]["source"] = str(data)
    spec["data"]["heldout"] = {"fraction": 0.1, "seed": 0}
    spec["training"].update({"max_steps": steps, "log_every": 10, "micro_batch_size": 8, "eval_rows": 16})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _train(path: Path, name: str, artifact_root: Path, stages=TRAIN_STAGES):
    defs = build_definitions([str(path)], artifact_root=str(artifact_root))
    job = defs.resolve_job_def(campaign_job_name(name))
    result = job.execute_in_process(
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
        asset_selection=[AssetKey([name, s]) for s in stages],
    )
    assert result.success
    return result


def test_logit_distillation_from_an_api_teacher_trains(tmp_path, artifact_root, demo_models):
    name = "api_logits"
    with teacher_server(demo_models["teacher"], "cipher-teacher") as url:
        path = _api_campaign(tmp_path, name, url, "cipher-teacher", items=120, steps=24)
        result = _train(path, name, artifact_root)
    tok = _metadata(result, AssetKey([name, "tokenized_dataset"]))
    assert tok["teacher_topk_examples"]["aligned"] == tok["examples_out"] > 80
    # the API's token text placed by bytes: the student's own tokenizer, so every answer token is exact
    assert tok["teacher_exact_positions"] == tok["loss_tokens"] and tok["teacher_uld_positions"] == 0
    train = _metadata(result, AssetKey([name, "student_adapter"]))
    metrics = pq.read_table(Path(str(train["metrics"]))).to_pylist()
    kl = [m["kl_loss"] for m in metrics]
    assert len(kl) == 24 and all(x is not None and math.isfinite(x) and x >= 0 for x in kl)
    assert sum(kl[-3:]) / 3 < sum(kl[:3]) / 3 / 2, kl
    assert train["distillation_alignment"]["shares"] == {"exact": 1.0, "uld": 0.0, "none": 0.0}


@pytest.mark.heavy
def test_the_shipped_cross_tokenizer_demo_reaches_go(tmp_path, artifact_root, xtok_teacher):
    """campaigns/demo_xtok.yaml as shipped: the BPE teacher's top-8 on the character student, to a GO verdict."""
    name = "demo_xtok"
    spec = yaml.safe_load((REPO / "campaigns" / "demo_xtok.yaml").read_text())
    spec.pop("schedule", None)
    spec["data"]["source"] = str(REPO / "campaigns" / "data" / "demo" / "*.jsonl")
    path = tmp_path / "demo_xtok.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = _train(path, name, artifact_root, (*TRAIN_STAGES, "evaluation"))
    tok = _metadata(result, AssetKey([name, "tokenized_dataset"]))
    assert tok["teacher_topk_examples"]["aligned"] == tok["examples_out"]
    assert tok["teacher_uld_share"] >= 0.2 and tok["teacher_exact_share"] > 0.2, tok
    assert tok["teacher_none_positions"] == 0
    ev = _metadata(result, AssetKey([name, "evaluation"]))
    assert ev["verdict"] == "GO", ev.get("report")
    train = _metadata(result, AssetKey([name, "student_adapter"]))
    metrics = pq.read_table(Path(str(train["metrics"]))).to_pylist()
    assert all(m["kl_loss"] is not None and math.isfinite(m["kl_loss"]) for m in metrics)
    assert train["distillation_alignment"]["shares"]["uld"] >= 0.2  # the trainer's summary says the same


@pytest.mark.heavy
def test_the_bpe_teacher_behind_an_api_aligns_by_its_token_text(tmp_path, artifact_root, xtok_teacher):
    """The BPE teacher served over HTTP: its tokens come back as text, and the dataset places them as the local
    teacher's ids would be: ULD groups where its tokens span several characters."""
    name = "api_xtok"
    with teacher_server(xtok_teacher, "bpe-teacher") as url:
        path = _api_campaign(tmp_path, name, url, "bpe-teacher", items=120, steps=10)
        result = _train(path, name, artifact_root)
    tok = _metadata(result, AssetKey([name, "tokenized_dataset"]))
    assert tok["teacher_topk_examples"]["aligned"] == tok["examples_out"] > 80
    assert tok["teacher_uld_share"] >= 0.2 and tok["teacher_exact_share"] > 0.2
    train = _metadata(result, AssetKey([name, "student_adapter"]))
    metrics = pq.read_table(Path(str(train["metrics"]))).to_pylist()
    assert all(m["kl_loss"] is not None and math.isfinite(m["kl_loss"]) for m in metrics)
