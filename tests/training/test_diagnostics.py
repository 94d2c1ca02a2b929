"""Node diagnostics as data: missing tools are skipped and noted, slow or failing ones never raise;
the distributed environment is validated once in the spec and exported as one dict."""

import sys

import pytest
from pydantic import ValidationError

from campaigns.spec import DiagnosticCommand, DiagnosticsSpec, DistributedEnvSpec, TrainingSpec
from training import diagnostics


def _training(**kw) -> TrainingSpec:
    return TrainingSpec(max_steps=1, **kw)


def test_default_commands_on_a_machine_without_gpu_or_infiniband(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing installed: the case of a CPU-only node
    t = _training()
    assert [c.command[0] for c in t.diagnostics.commands] == ["nvidia-smi"] * 4 + ["ibstat"]
    node = diagnostics.collect(t)
    assert [r["status"] for r in node["commands"]] == ["missing"] * 5
    assert "`nvidia-smi` is not installed" in node["commands"][0]["note"]
    index = diagnostics.write([node], tmp_path / "diag")
    assert all("file" not in r for r in index[0]["commands"])  # nothing ran, nothing written
    assert "missing 5" in diagnostics.summary_line(index)


def test_timeout_failure_and_success_are_noted_not_raised(tmp_path):
    py = sys.executable
    cmds = [
        DiagnosticCommand(
            name="slow", command=[py, "-c", "import time; print('partial', flush=True); time.sleep(600)"], timeout_s=1.5
        ),
        DiagnosticCommand(name="broken", command=[py, "-c", "import sys; sys.exit('no such device')"]),
        DiagnosticCommand(name="fine", command=[py, "-c", "print('GPU0 X NV18')"]),
        DiagnosticCommand(name="absent", command=["definitely-not-a-tool-xyz"]),
    ]
    rows = diagnostics.run_commands(cmds)
    by = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == ["slow", "broken", "fine", "absent"]
    # cut at its timeout: far under the 600 s it would run, whatever the host's load adds to starting and reaping it
    assert by["slow"]["status"] == "timeout" and "1.5 s" in by["slow"]["note"] and by["slow"]["seconds"] < 300
    assert by["broken"]["status"] == "failed" and "no such device" in by["broken"]["note"]
    assert by["fine"]["status"] == "ok" and "NV18" in by["fine"]["output"]
    assert by["absent"]["status"] == "missing"
    index = diagnostics.write(
        [{"node": 0, "local_rank": 0, "rank": 0, "host": "h", "env": {}, "commands": rows}], tmp_path
    )
    saved = (tmp_path / "node0" / "fine.txt").read_text()
    assert saved.startswith(f"$ {py} -c") and "NV18" in saved
    assert not (tmp_path / "node0" / "absent.txt").exists()
    assert "output" not in index[0]["commands"][0]


def test_diagnostics_can_be_switched_off_and_names_are_unique():
    assert diagnostics.collect(_training(diagnostics=DiagnosticsSpec(enabled=False)))["commands"] == []
    with pytest.raises(ValidationError, match="unique"):
        DiagnosticsSpec(
            commands=[DiagnosticCommand(name="a", command=["x"]), DiagnosticCommand(name="a", command=["y"])]
        )


def test_distributed_env_is_validated_and_exported_as_one_dict():
    t = _training(
        distributed_env=DistributedEnvSpec(
            NCCL_DEBUG="INFO",
            NCCL_DEBUG_SUBSYS="INIT,NET",
            NCCL_IB_HCA="=mlx5_0:1,mlx5_1:1",
            NCCL_SOCKET_IFNAME="^docker,lo",
            TORCH_NCCL_ASYNC_ERROR_HANDLING=1,
        )
    )
    assert diagnostics.distributed_env(t) == {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1",
        "NCCL_SOCKET_IFNAME": "^docker,lo",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    assert diagnostics.distributed_env(_training()) == {}  # nothing set: NCCL's defaults
    with pytest.raises(ValidationError, match="NCCL_DEBUG"):
        DistributedEnvSpec(NCCL_DEBUG="LOUD")
    with pytest.raises(ValidationError, match="unknown NCCL subsystem"):
        DistributedEnvSpec(NCCL_DEBUG_SUBSYS="INIT,NETWORK")
    with pytest.raises(ValidationError, match=r"\[\^\]\[=\]name"):
        DistributedEnvSpec(NCCL_IB_HCA="mlx5_0 mlx5_1")
    with pytest.raises(ValidationError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        DistributedEnvSpec(TORCH_NCCL_ASYNC_ERROR_HANDLING=5)
    with pytest.raises(ValidationError, match="extra"):
        DistributedEnvSpec(NCCL_DEBUGG="INFO")


def test_adapter_key_ignores_env_and_diagnostics_but_not_profiling():
    from campaigns.loader import load_campaign_file
    from campaigns.paths import shipped_campaigns_dir
    from stages.student_adapter import training_key_fields

    spec = load_campaign_file(shipped_campaigns_dir() / "demo.yaml")
    noisy = spec.model_copy(
        update={"training": spec.training.model_copy(update={"distributed_env": DistributedEnvSpec(NCCL_DEBUG="INFO")})}
    )
    assert training_key_fields(noisy) == training_key_fields(spec)
    on = spec.model_copy(
        update={
            "training": spec.training.model_copy(
                update={"profiling": spec.training.profiling.model_copy(update={"enabled": True})}
            )
        }
    )
    assert training_key_fields(on) != training_key_fields(spec)  # a profiled run keeps its traces in its own dir
