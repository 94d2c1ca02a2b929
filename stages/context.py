"""What a stage gets besides its spec and inputs: a plain object of this project's, never Dagster's context.

The Dagster assets build one from their resources and context (``assets/common.py: stage_context``); a test or a
script builds one directly (``StageContext(store=Store(root=tmp))``). Everything a stage calls lives at or below
its layer, except the launchers it is handed (``train``, ``kuberay``) and the sweep's ``on_trial`` report, which
the adapter binds to its own run. What the stages hand down to be called back (progress, log, meters, prices) lives
in the library (``campaign_orchestrator.progress``, ``campaign_orchestrator.costs.meters``), so no call climbs back
up into this layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from campaign_orchestrator.progress import LoggerLog, RunProgress
from stages.storage import Store


class Log(Protocol):
    def info(self, msg: str) -> Any: ...

    def warning(self, msg: str) -> Any: ...


@dataclass(frozen=True)
class TeacherSettings:
    """What the ``teacher`` resource configures for every teacher the stages build."""

    vllm_chunk_size: int | None = None  # prompts per vllm.LLM.generate call (a cache checkpoint); None: batch_size


def _default_pricing():
    from stages.pricing import Pricing

    return Pricing()


@dataclass
class StageContext:
    """``store``: where artifacts and the generation cache are; ``pricing``: prices, ledger, budget guards;
    ``run_id``/``step_key``/``attempt``: what the ledger records a stage's lines under; ``log``: the run's log;
    ``train``: ``launch(job, workdir, budget=None, **cluster) -> dict`` (a training launcher bound to the run);
    ``kuberay``: ``launch(spec, stage, job, workdir, budget=None, on_shard=None) -> dict`` (a KubeRay RayJob
    launcher bound to the run, for ``execution.kuberay``); ``on_trial(trial, sweep_key)``: a sweep trial's report
    (rung or state change) to the orchestrator."""

    store: Store = field(default_factory=Store)
    pricing: Any = field(default_factory=_default_pricing)  # stages.pricing.Pricing
    run_id: str = "local"
    step_key: str = "local"
    attempt: int = 0
    log: Log = field(default_factory=LoggerLog)
    teacher: TeacherSettings = field(default_factory=TeacherSettings)
    train: Callable[..., dict] | None = None
    kuberay: Callable[..., dict] | None = None
    on_trial: Callable[[Any], None] | None = None

    def progress(self, total: int, label: str, unit: str = "it") -> RunProgress:
        """A progress bar for ``total`` units that logs every ~10% to the run's log."""
        return RunProgress(self.log.info, total, label, unit)
