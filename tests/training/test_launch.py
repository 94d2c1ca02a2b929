"""Launch plumbing and the training spec: torchrun commands, supervision, live metrics, validation."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tests.support.train_support import REPO_ROOT


def test_torchrun_commands_one_per_node_with_c10d_rendezvous():
    from resources.local_launcher import torchrun_commands

    one = torchrun_commands(Path("/j.json"), 1, 4, "py", 1234, "run")
    assert one == [
        [
            "py",
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            "--max-restarts",
            "0",
            "--standalone",
            "-m",
            "training",
            "--config",
            "/j.json",
        ]
    ]
    two = torchrun_commands(Path("/j.json"), 2, 8, "py", 1234, "run", host="10.0.0.5")
    assert len(two) == 2
    for rank, cmd in enumerate(two):
        assert cmd[cmd.index("--node-rank") + 1] == str(rank)
        assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "8"
        assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
        assert cmd[cmd.index("--rdzv-endpoint") + 1] == "10.0.0.5:1234"
        assert cmd[-4:] == ["-m", "training", "--config", "/j.json"]  # the trainer CLI a pod runs too


def test_supervise_stops_the_other_nodes_when_one_fails(tmp_path):
    from resources.local_launcher import NodeFailed, supervise
    from tests.support.processes import sleeping_node

    logs = [tmp_path / "n0.log", tmp_path / "n1.log"]
    procs = [
        sleeping_node(logs[0]),
        subprocess.Popen(
            [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
            stdout=logs[1].open("w"),
            start_new_session=True,
        ),
    ]
    with pytest.raises(NodeFailed, match="node 1 exited with code 3") as e:
        supervise(procs, logs, time.monotonic() + 30, poll_s=0.05)
    assert e.value.log == logs[1]
    # stopped, not left to its minute: a node that ended by itself exits 0, a stopped one by the signal
    assert procs[0].poll() in (-signal.SIGTERM, -signal.SIGKILL), procs[0].returncode


def test_metric_messages_become_observations_once():
    from resources.local_launcher import metric_observations

    msgs = [{"kind": "train_metrics", "step": 5, "loss": 1.5, "kl_loss": None, "lr": 1e-3}, {"kind": "other"}]
    rows, seen = metric_observations(msgs, 0)
    assert rows == [{"step": 5, "loss": 1.5, "lr": 1e-3}] and seen == 2
    msgs.append({"kind": "train_metrics", "step": 10, "loss": 1.0})
    rows, seen = metric_observations(msgs, seen)
    assert rows == [{"step": 10, "loss": 1.0}] and seen == 3


def _demo() -> dict:
    return yaml.safe_load((REPO_ROOT / "campaigns" / "demo.yaml").read_text())


def test_training_spec_defaults_and_validation():
    from campaigns.spec import CampaignSpec

    for name in ("demo.yaml", "demo_broken.yaml"):
        CampaignSpec.model_validate(yaml.safe_load((REPO_ROOT / "campaigns" / name).read_text()))
    d = _demo()
    d["training"]["distillation"] = {"loss": "logits"}
    with pytest.raises(ValidationError, match="teacher.sampling.logprobs"):
        CampaignSpec.model_validate(d)
    d["teacher"]["sampling"]["logprobs"] = 8
    assert CampaignSpec.model_validate(d).training.distillation.kl_weight == 0.5
    d["training"]["checkpoint"] = {"remote_uri": "gs://bucket/x"}
    with pytest.raises(ValidationError, match="s3://bucket"):
        CampaignSpec.model_validate(d)
    d["training"]["checkpoint"] = {"remote_uri": "s3://my-bucket/runs", "every_steps": 100, "keep_last": 3}
    d["training"].update(nodes=4, processes_per_node=8, sharding="hybrid")
    t = CampaignSpec.model_validate(d).training
    assert (t.world_size, t.effective_batch) == (32, 32 * t.micro_batch_size * t.gradient_accumulation_steps)


def test_checkpoint_and_timeout_settings_do_not_change_the_adapter_key():
    from campaigns.spec import CampaignSpec
    from stages.student_adapter import training_key_fields

    a = CampaignSpec.model_validate(_demo())
    d = _demo()
    d["training"].update(checkpoint={"every_steps": 7, "keep_last": 9}, collective_timeout_s=60, log_every=3)
    b = CampaignSpec.model_validate(d)
    assert training_key_fields(a) == training_key_fields(b)  # a relaunch with them changed still resumes
    d["training"]["sharding"] = "hybrid"
    assert training_key_fields(CampaignSpec.model_validate(d)) != training_key_fields(a)
