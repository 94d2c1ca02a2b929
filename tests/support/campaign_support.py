"""Small, fast campaigns for end-to-end tests: the demo campaign shrunk (few prompts, a few fp32
LoRA steps, a small gate), with the teacher and student given as arguments, written into a project
folder of their own; and the `campaign` CLI run as a separate process on a Dagster instance home."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from campaign_orchestrator.demo import cipher
from tests.support import REPO_ROOT


def openai_teacher(base_url: str, *, price: str = "api-open-70b", max_concurrency: int = 4, **extra) -> dict:
    """A teacher answered by an OpenAI-compatible server (tests.support.testserver serves ``teacher``)."""
    return {
        "backend": "openai",
        "model": "teacher",
        "base_url": base_url,
        "price": price,
        "max_concurrency": max_concurrency,
        "max_retries": 2,
        "request_timeout_s": 30,
        "sampling": {"max_new_tokens": 16},
        **extra,
    }


def demo_teacher() -> dict:
    return {
        "backend": "transformers",
        "model": "@demo/teacher",
        "hardware": "cpu-2vcpu",
        "batch_size": 64,
        "sampling": {"max_new_tokens": 16},
    }


def write_campaign(
    project: Path,
    name: str,
    teacher: dict,
    student: str = "@demo/student",
    *,
    prompts: int = 120,
    seed: int = 99,
    max_steps: int = 2,
    **sections,
) -> Path:
    """``<project>/campaigns/<name>.yaml`` (and its prompt file); ``sections`` replace whole sections."""
    spec = yaml.safe_load((REPO_ROOT / "campaigns" / "demo.yaml").read_text())
    data = project / "data" / f"{name}.jsonl"
    cipher.write_jsonl(cipher.items(prompts, seed=seed), data)
    spec.pop("schedule", None)
    spec.pop("automation", None)
    spec |= {"name": name, "teacher": teacher, "cost": {}}
    spec["student"] = {
        "base_model": student,
        "lora": {"r": 8, "alpha": 16},
        "quantization": {"load_in_4bit": False, "compute_dtype": "float32"},
    }
    spec["data"]["source"] = str(data)
    spec["data"]["heldout"] = {"fraction": 0.1, "seed": 0}
    spec["training"] |= {
        "max_steps": max_steps,
        "micro_batch_size": 4,
        "log_every": 1,
        "eval_rows": 8,
        "diagnostics": {"enabled": False},
    }
    spec["evaluation"]["suites"] = spec["evaluation"]["suites"][:1]
    spec["evaluation"]["gate"] |= {"min_items": 5, "min_category_items": 5}
    spec["evaluation"]["statistics"] |= {"resamples": 500}
    spec |= sections
    path = project / "campaigns" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def instance_home(path: Path, storage_yaml: str | None = None) -> Path:
    """A ``DAGSTER_HOME`` with the shipped instance settings (pools: ``default_limit: 1``), on SQLite
    (the default) or on the storage given as a dagster.yaml ``storage:`` section (PostgreSQL)."""
    path.mkdir(parents=True, exist_ok=True)
    shipped = (REPO_ROOT / "campaign_app" / "dagster.yaml").read_text()
    (path / "dagster.yaml").write_text(shipped + ("\n" + storage_yaml if storage_yaml else ""))
    return path


def cli_env(home: Path, **extra: str) -> dict:
    return {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def start_cli(args: list[str], project: Path, home: Path, log: Path) -> subprocess.Popen:
    """``campaign ARGS`` in its own process (cwd: the project), stdout and stderr to ``log``."""
    return subprocess.Popen(
        [sys.executable, "-m", "campaign_app.cli", *args],
        cwd=project,
        env=cli_env(home),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
