"""Launch ``python -m training`` under torchrun as local subprocesses, reporting through Pipes.

``nodes`` > 1 starts one torchrun per "node" on this machine, each with its ``--node-rank``
and a shared c10d rendezvous, exactly the command a Kubernetes pod of a multi-node job runs.
If any process fails, the others are stopped at once and the asset fails with the failing
node's exit code and last log lines.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dagster import ConfigurableResource, Failure, MetadataValue, PipesTempFileContextInjector, \
    PipesTempFileMessageReader, open_pipes_session
from pydantic import Field

from training.config import TrainJob
from training.diagnostics import distributed_env

REPO_ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_commands(job_file: Path, nodes: int, procs: int, python: str, port: int, run_id: str) -> list[list[str]]:
    """One torchrun command per node (pure: unit-tested)."""
    base = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(procs)]
    tail = ["-m", "training", "--config", str(job_file)]
    if nodes == 1:
        return [base + ["--standalone"] + tail]
    return [
        base + ["--nnodes", str(nodes), "--node-rank", str(i), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id] + tail
        for i in range(nodes)
    ]


def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


class LocalTorchrunLauncher(ConfigurableResource):
    """Runs training as torchrun subprocesses on this machine (the default launcher)."""

    python: str | None = Field(None, description="Interpreter for torchrun; default: the one running Dagster.")
    timeout_s: int = Field(6 * 3600, description="Stop training after this many seconds.")
    threads_per_process: int | None = Field(None, description="OMP threads per rank; default: cores / ranks.")

    def launch(self, context, job: TrainJob, workdir: Path, budget=None) -> dict:
        """``budget``: a ``costs.budget.BudgetGuard`` checked while training runs; when it stops the
        stage, every process is terminated (SIGTERM, as on preemption) and its failure is raised."""
        workdir.mkdir(parents=True, exist_ok=True)
        job_file = job.write(workdir / "train_job.json")
        t = job.training
        cmds = torchrun_commands(job_file, t.nodes, t.processes_per_node, self.python or sys.executable,
                                 _free_port(), f"{job.campaign}-{os.getpid()}")
        threads = self.threads_per_process or max(1, (os.cpu_count() or 1) // t.world_size)
        with open_pipes_session(context=context, context_injector=PipesTempFileContextInjector(),
                                message_reader=PipesTempFileMessageReader(),
                                extras={"campaign": job.campaign}) as session:
            env = {**os.environ, **session.get_bootstrap_env_vars(), "OMP_NUM_THREADS": str(threads),
                   "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   "TOKENIZERS_PARALLELISM": "false", **distributed_env(job.training)}
            procs, logs = [], []
            for i, cmd in enumerate(cmds):
                log = workdir / f"node-{i}.log"
                logs.append(log)
                procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log.open("w"),
                                              stderr=subprocess.STDOUT, start_new_session=True))
            context.log.info(f"launched {len(procs)} torchrun process(es): {' '.join(cmds[0])}")
            self._wait(procs, logs, time.monotonic() + self.timeout_s, budget)
            results = list(session.get_results())
        summary_file = Path(job.output_dir) / "summary.json"
        if not summary_file.exists():
            raise Failure(f"training exited 0 but wrote no {summary_file}", metadata={"log": MetadataValue.path(str(logs[0]))})
        pipes_md = {}
        for r in results:
            pipes_md.update(getattr(r, "metadata", None) or {})
        return {"logs": [str(p) for p in logs], "pipes_metadata": pipes_md}

    @staticmethod
    def _wait(procs: list[subprocess.Popen], logs: list[Path], deadline: float, budget=None) -> None:
        def stop_all() -> None:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)

        try:
            while True:
                codes = [p.poll() for p in procs]
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    i = failed[0]
                    stop_all()
                    raise Failure(
                        f"training node {i} exited with code {codes[i]}; stopped the other nodes",
                        metadata={"log": MetadataValue.path(str(logs[i])), "last_lines": MetadataValue.md(f"```\n{_tail(logs[i])}\n```")},
                    )
                if all(c == 0 for c in codes):
                    return
                if budget is not None:
                    budget.check()
                if time.monotonic() > deadline:
                    stop_all()
                    raise Failure(f"training exceeded the launcher timeout; stopped. Log: {logs[0]}")
                time.sleep(0.5)
        except BaseException:
            stop_all()
            raise
