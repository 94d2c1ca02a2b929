"""Settings of the cluster validation ladder (the ``cluster`` asset group): the shape to test,
the sweep's range, the thresholds against the baseline, and the tiny training run."""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field, field_validator


class ClusterValidation(ConfigurableResource):
    nodes: int = Field(1, ge=1, description="Nodes to test (torchrun --nnodes; on one machine: one torchrun each).")
    processes_per_node: int = Field(2, ge=1, description="Processes per node, one per GPU (gloo on CPU).")
    max_bytes: str = Field("16M", description="Largest message of the bandwidth sweep (8 B doubling up to this).")
    iters: int = Field(10, ge=1, description="Timed calls per message size.")
    warmup: int = Field(3, ge=0, description="Untimed calls per message size before timing.")
    plateau_drop: float = Field(0.25, gt=0, description="Allowed relative drop of a bus-bandwidth plateau vs baseline.")
    latency_rise: float = Field(0.5, gt=0, description="Allowed relative rise of a latency floor vs baseline.")
    throughput_drop: float = Field(
        0.3, gt=0, description="Allowed relative drop of tiny-training tokens/s vs baseline."
    )
    score_drop: float = Field(0.05, gt=0, description="Allowed relative drop of the eval score vs baseline.")
    baseline_dir: str | None = Field(
        None, description="Where baselines live; default <artifact root>/cluster/baselines."
    )
    rebaseline: bool = Field(False, description="Record this run as the new baseline (after an intended change).")
    train_steps: int = Field(150, ge=1, description="Optimizer steps of the tiny training run (the demo's recipe).")
    learning_rate: float = Field(5e-3, gt=0, description="Peak learning rate of the tiny training run.")
    train_items: int = Field(2400, ge=16, description="Training pairs of the tiny cipher task.")
    micro_batch_size: int = Field(16, ge=1, description="Sequences per process per step in the tiny training run.")
    eval_items: int = Field(60, ge=1, description="Held-out items the eval gate scores (candidate and base).")
    gate_min_score: float = Field(0.8, ge=0, le=1, description="The eval gate's score floor.")
    timeout_s: int = Field(1800, ge=10, description="Stop any rung's processes after this many seconds.")
    distributed_env: dict[str, str] = Field(
        default_factory=dict,
        description="NCCL / torch.distributed variables for every rung (same names and "
        "validation as a campaign's training.distributed_env).",
    )

    @field_validator("max_bytes")
    @classmethod
    def _bytes(cls, v: str) -> str:
        from training.cluster.collectives import parse_bytes

        if parse_bytes(v) < 8:
            raise ValueError(f"max_bytes must be at least 8, got {v!r}")
        return v

    def env(self) -> dict[str, str]:
        from campaigns.spec import DistributedEnvSpec

        return DistributedEnvSpec(**self.distributed_env).env()

    def baselines(self, artifact_root: Path) -> Path:
        return Path(self.baseline_dir) if self.baseline_dir else artifact_root / "cluster" / "baselines"
