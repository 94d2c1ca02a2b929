"""Run ``python -m <module> ...`` under torchrun on this machine: one node, or several "nodes"
(one torchrun each, ``--node-rank i``, a shared c10d rendezvous on 127.0.0.1), exactly the
commands the pods of a multi-node job run. Used by the cluster validation ladder's rungs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from campaigns import paths
from training.net import free_port


class LaunchError(RuntimeError):
    pass


def torchrun_commands(
    target: list[str], nodes: int, procs: int, python: str, port: int, run_id: str, host: str = "127.0.0.1"
) -> list[list[str]]:
    """One torchrun command per node (pure: unit-tested); ``target`` is what follows (``["-m", "training",
    "--config", FILE]`` for the trainer: :func:`resources.local_launcher.torchrun_commands`, or
    ``["-m", "training.cluster.collectives", ...]``). The one place a torchrun command is built on this machine.
    No restarts inside torchrun (its default, said aloud): a failed rank fails the job, and the next launch resumes
    from the last complete checkpoint."""
    base = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--max-restarts", "0"]
    if nodes == 1:
        return [base + ["--standalone"] + target]
    return [
        base
        + [
            "--nnodes",
            str(nodes),
            "--node-rank",
            str(i),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{host}:{port}",
            "--rdzv-id",
            run_id,
        ]
        + target
        for i in range(nodes)
    ]


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_torchrun(
    target: list[str],
    nodes: int,
    procs: int,
    log_dir: Path,
    env: dict[str, str] | None = None,
    timeout_s: float = 900,
    python: str | None = None,
) -> list[Path]:
    """Run to completion; on a failure or timeout stop every node and raise :class:`LaunchError` with the log tail."""
    log_dir.mkdir(parents=True, exist_ok=True)
    cmds = torchrun_commands(target, nodes, procs, python or sys.executable, free_port(), uuid.uuid4().hex[:12])
    threads = max(1, (os.cpu_count() or 1) // (nodes * procs))
    full_env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    logs = [log_dir / f"node-{i}.log" for i in range(len(cmds))]
    procs_ = [
        subprocess.Popen(
            c,
            cwd=paths.project_dir(),
            env=full_env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for c, log in zip(cmds, logs, strict=True)
    ]

    def stop_all() -> None:
        for p in procs_:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs_:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs_]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                stop_all()
                i = bad[0]
                raise LaunchError(
                    f"`{' '.join(target)}` failed on node {i} (exit code {codes[i]}); log {logs[i]}:\n{_tail(logs[i])}"
                )
            if all(c == 0 for c in codes):
                return logs
            if time.monotonic() > deadline:
                stop_all()
                raise LaunchError(
                    f"`{' '.join(target)}` did not finish within {timeout_s:g} s; log {logs[0]}:\n{_tail(logs[0])}"
                )
            time.sleep(0.2)
    except BaseException:
        stop_all()
        raise
