"""The project installed non-editable into a fresh venv: exactly the five requested packages, the
library below them and the app on top land at top level, and `campaign` validates and runs a campaign from another
folder
(paths come from the working directory and the campaign file, never from the checkout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import yaml

from campaign_orchestrator.demo import cipher
from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow

TOP_LEVEL = {
    "campaigns",
    "assets",
    "resources",
    "stages",
    "training",
    "evaluation",
    "campaign_orchestrator",
    "campaign_app",
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the project installed from a wheel-style (non-editable) build; its
    dependencies come from this environment's site-packages (a path entry, so none of its .pth
    files, the editable finder included, is read)."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root)
    py = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(REPO_ROOT),
        ],
        check=True,
        cwd=root,
    )
    return root


def test_installs_only_the_eight_top_level_names(installed):
    py = installed / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (record,) = site.glob("campaign_orchestrator-*.dist-info/RECORD")
    tops = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
    tops = {t.removesuffix(".py") for t in tops if not t.endswith(".dist-info") and t not in ("..", "bin")}
    assert tops == TOP_LEVEL
    code = "import campaign_orchestrator, campaigns; print(campaign_orchestrator.__file__, campaigns.__file__)"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True, cwd=installed).stdout
    assert str(REPO_ROOT) not in out and str(site) in out  # the installed copy, not the checkout
    tasks = site / "campaigns" / "lm_eval_tasks" / "cipher"  # the shipped harness tasks are package data
    assert {p.name for p in tasks.iterdir()} >= {
        "cipher.yaml",
        "cipher_gen.yaml",
        "cipher_gen.jsonl",
        "cipher_mc.jsonl",
    }


def test_validate_and_run_a_campaign_outside_the_checkout(installed, tmp_path, artifact_root):
    py = installed / "bin" / "python"
    project = tmp_path / "my_project"
    (project / "campaigns").mkdir(parents=True)
    cipher.write_jsonl(cipher.items(700, seed=99), project / "data" / "prompts.jsonl")
    spec = yaml.safe_load((REPO_ROOT / "campaigns" / "demo.yaml").read_text())
    spec.update(name="outside", schedule=None)
    spec["data"].update(source="data/prompts.jsonl", heldout={"fraction": 0.12, "seed": 0})
    spec["training"].update(max_steps=80, log_every=20)
    spec["evaluation"]["gate"]["min_items"] = 40
    # the harness suite's task directory is the checkout's (campaigns/lm_eval_tasks): left out here, where
    # the point is paths of an installed copy (tests/e2e/test_campaign.py gates on it end to end)
    spec["evaluation"]["suites"] = [x for x in spec["evaluation"]["suites"] if x.get("kind") != "lm_eval"]
    spec["cost"].pop("catalog", None)  # the shipped catalog, found as package data
    (project / "campaigns" / "outside.yaml").write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "PYTHONPATH", "CAMPAIGN_PROJECT_DIR")}
    cli = [str(py), "-m", "campaign_app.cli"]

    shipped = subprocess.run([*cli, "validate"], cwd=tmp_path, env=env, capture_output=True, text=True)
    n_shipped = len(list((REPO_ROOT / "campaigns").glob("*.yaml")))
    assert shipped.returncode == 0 and f"{n_shipped} valid, 0 invalid" in shipped.stdout, (
        shipped.stdout + shipped.stderr
    )
    mine = subprocess.run([*cli, "validate"], cwd=project, env=env, capture_output=True, text=True)
    assert mine.returncode == 0 and "campaigns/outside.yaml" in mine.stdout and "1 valid" in mine.stdout, mine.stdout

    run = subprocess.run(
        [*cli, "run", "outside", "--artifacts", str(artifact_root), "--log-level", "WARNING"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert "gate verdict: GO" in run.stdout
    latest = json.loads((artifact_root / "outside" / "evaluation" / "LATEST.json").read_text())
    assert Path(latest["path"]).is_relative_to(artifact_root)
    assert (project / ".dagster_home" / "dagster.yaml").exists()  # the instance lives in the project, from package data
    assert not (REPO_ROOT / "artifacts" / "outside").exists()
