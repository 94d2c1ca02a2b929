"""Launch ``python -m training`` under torchrun as local subprocesses, reporting through Pipes.

``nodes`` > 1 starts one torchrun per "node" on this machine, each with its ``--node-rank``
and a shared c10d rendezvous, exactly the command a Kubernetes pod of a multi-node job runs.
If any process fails, the others are stopped at once and the asset fails with the failing
node's exit code and last log lines.

The run owns its trainers: each torchrun gets SIGKILL from the kernel when the process that launched
it dies (``PR_SET_PDEATHSIG``, ``training.trainer_guards``), its workers do the same with torchrun, every
process carries the Dagster run id (``CAMPAIGN_RUN_ID``) and the launch records the process groups
(pgid, start time, boot id, PID namespace) in the run's owner record (``campaign/owner``), so the reaper
(``assets/run_recovery.py``) kills whatever is left of a dead run before it frees its pool slot. Metrics the trainer
streams (global rank 0, through
Pipes) become ``AssetObservation`` events while training runs, so the asset's plots fill live.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dagster import (
    AssetObservation,
    ConfigurableResource,
    Failure,
    MetadataValue,
    PipesTempFileContextInjector,
    PipesTempFileMessageReader,
    open_pipes_session,
)
from pydantic import Field

from campaign_orchestrator import allocator
from campaigns import paths
from resources import run_owner
from stages.pricing import charge_round
from training import run_processes
from training.cluster import torchrun as cluster_torchrun
from training.config import TrainJob
from training.diagnostics import distributed_env
from training.net import free_port
from training.trainer_guards import DIE_WITH_PARENT_ENV, RUN_ID_ENV, parent_death_preexec


def torchrun_commands(
    job_file: Path, nodes: int, procs: int, python: str, port: int, run_id: str, host: str = "127.0.0.1"
) -> list[list[str]]:
    """One torchrun command per node around ``python -m training --config FILE``, built where every torchrun command
    on this machine is (:func:`training.cluster.torchrun.torchrun_commands`: no restarts inside torchrun, a failed
    rank fails the job and the next launch resumes from the last complete checkpoint)."""
    target = ["-m", "training", "--config", str(job_file)]
    return cluster_torchrun.torchrun_commands(target, nodes, procs, python, port, run_id, host)


class NodeFailed(RuntimeError):
    def __init__(self, node: int, code: int | None, log: Path, timed_out: bool = False):
        self.node, self.code, self.log, self.timed_out = node, code, log, timed_out
        what = "exceeded the launcher timeout" if timed_out else f"exited with code {code}"
        super().__init__(f"training node {node} {what}; stopped the other nodes")


def stop_all(procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    """SIGTERM every node's process group (the trainer checkpoints on it), then SIGKILL what is left after
    ``grace_s`` (one grace period for all of them, not one per node)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def supervise(
    procs: list[subprocess.Popen],
    logs: list[Path],
    deadline: float,
    on_tick: Callable[[], None] | None = None,
    poll_s: float = 0.5,
) -> None:
    """Wait for every node; the first non-zero exit (or the deadline) stops the rest and raises ``NodeFailed``."""
    try:
        while True:
            if on_tick is not None:
                on_tick()
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i = failed[0]
                stop_all(procs)
                raise NodeFailed(i, codes[i], logs[i])
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                stop_all(procs)
                raise NodeFailed(0, None, logs[0], timed_out=True)
            time.sleep(poll_s)
    except BaseException:
        stop_all(procs)
        raise


def metric_observations(messages, seen: int) -> tuple[list[dict], int]:
    """New ``train_metrics`` rows among the Pipes custom messages, and the new count seen."""
    rows = [m for m in list(messages)[seen:] if isinstance(m, dict) and m.get("kind") == "train_metrics"]
    return [{k: v for k, v in m.items() if k != "kind" and isinstance(v, (int, float))} for m in rows], len(messages)


def round_messages(messages, seen: int) -> list[dict]:
    """New ``on_policy_round`` rows among the Pipes custom messages (a finished on-policy round: what the teacher
    scored, for the budget guard: ``stages.pricing.charge_round``)."""
    return [m for m in list(messages)[seen:] if isinstance(m, dict) and m.get("kind") == "on_policy_round"]


def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def record_trainers(context, procs: list[subprocess.Popen]) -> None:
    """Add the trainers' process groups to the run's owner record (``resources/run_owner.py``: ``trainers``), so a
    reaper that finds the run dead kills them before it frees the run's pool slot."""
    groups = [run_processes.group_record(p.pid, i) for i, p in enumerate(procs)]
    try:
        tags = context.instance.get_run_by_id(context.run_id).tags
        old = run_owner.read(tags)["trainers"]
        context.instance.add_run_tags(context.run_id, run_owner.updated(tags, trainers=old + groups))
    except Exception as e:  # noqa: BLE001 - no run in storage (a bare context): the run id in the env remains
        context.log.debug(f"could not record the trainer processes in the run's tags: {e}")


class LocalTorchrunLauncher(ConfigurableResource):
    """Runs training as torchrun subprocesses on this machine (the default launcher)."""

    python: str | None = Field(None, description="Interpreter for torchrun; default: the one running Dagster.")
    timeout_s: int = Field(6 * 3600, description="Stop training after this many seconds.")
    threads_per_process: int = Field(
        1,
        ge=1,
        description="OpenMP threads per rank (torchrun's own default). Small models are bound by per-op overhead, "
        "where more threads only add synchronization (the demo trains 4-8x faster with 1 than with 2 on a busy "
        "2-core machine); raise it for CPU training of larger models.",
    )

    def launch(self, context, job: TrainJob, workdir: Path, budget=None) -> dict:
        """``budget``: a ``campaign_orchestrator.costs.budget.BudgetGuard`` checked while training runs; when it stops
        the
        stage, every process is terminated (SIGTERM, as on preemption: the trainer checkpoints) and
        its failure is raised."""
        workdir.mkdir(parents=True, exist_ok=True)
        job_file = job.write(workdir / "train_job.json")
        t = job.training
        cmds = torchrun_commands(
            job_file,
            t.nodes,
            t.processes_per_node,
            self.python or sys.executable,
            free_port(),
            f"{job.campaign}-{os.getpid()}-{int(time.time())}",
        )
        threads = self.threads_per_process
        with open_pipes_session(
            context=context,
            context_injector=PipesTempFileContextInjector(),
            message_reader=PipesTempFileMessageReader(),
            extras={"campaign": job.campaign},
        ) as session:
            env = {
                **os.environ,
                **session.get_bootstrap_env_vars(),
                "OMP_NUM_THREADS": str(threads),
                "TOKENIZERS_PARALLELISM": "false",
                **distributed_env(job.training),
            }
            env |= allocator.preload_env(env)  # jemalloc when the host has it (campaign_orchestrator.allocator)
            env |= {RUN_ID_ENV: context.run_id, DIE_WITH_PARENT_ENV: "1"}  # the trainers die with this process
            procs, logs = [], []
            for i, cmd in enumerate(cmds):
                log = workdir / f"node-{i}.log"
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=paths.project_dir(),
                        env=env,
                        stdout=log.open("a"),
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=parent_death_preexec(),
                    )
                )
            record_trainers(context, procs)
            context.log.info(f"launched {len(procs)} torchrun process(es): {' '.join(cmds[0])}")
            seen = 0

            def observe() -> None:
                nonlocal seen
                msgs = session.get_custom_messages()
                rounds = round_messages(msgs, seen)
                rows, seen = metric_observations(msgs, seen)
                for row in rows:
                    context.log_event(AssetObservation(asset_key=context.asset_key, metadata=row))
                if budget is not None:
                    for r in rounds:  # an API teacher's prefills of a finished round: charged, then checked
                        charge_round(budget, r)
                    budget.check()  # raises to stop the stage: supervision then stops every node

            self._wait(procs, logs, time.monotonic() + self.timeout_s, on_tick=observe)
            observe()
            results = list(session.get_results())
        summary_file = Path(job.output_dir) / "summary.json"
        if not summary_file.exists():
            raise Failure(
                f"training exited 0 but wrote no {summary_file}", metadata={"log": MetadataValue.path(str(logs[0]))}
            )
        pipes_md = {}
        for r in results:
            pipes_md.update(getattr(r, "metadata", None) or {})
        return {"logs": [str(p) for p in logs], "pipes_metadata": pipes_md}

    @staticmethod
    def _wait(
        procs: list[subprocess.Popen],
        logs: list[Path],
        deadline: float,
        budget=None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        """Supervise the nodes (``supervise``); a failed node becomes a Dagster ``Failure``."""
        if on_tick is None and budget is not None:
            on_tick = budget.check
        try:
            supervise(procs, logs, deadline, on_tick=on_tick)
        except NodeFailed as e:
            raise Failure(
                str(e) + ("" if e.timed_out else "; relaunching resumes from the last complete checkpoint"),
                metadata={
                    "log": MetadataValue.path(str(e.log)),
                    "last_lines": MetadataValue.md(f"```\n{_tail(e.log)}\n```"),
                },
            ) from None
