"""Node diagnostics as data, and the distributed environment declared in the campaign.

* :func:`run_commands` runs the commands of ``training.diagnostics`` (argv lists, no shell), all at
  once, each under its own timeout. A command that is not installed (no GPU driver, no InfiniBand
  tools: the case on a CPU machine) is *skipped and noted*, a timeout or a non-zero exit is noted
  with whatever output came: none of them is ever an error, because diagnostics must not fail the
  run they describe.
* :func:`distributed_env` is the one place that turns ``training.distributed_env`` into the
  environment variables every rank gets (the local launcher passes them to torchrun, the
  Kubernetes launcher renders them into the pods).
* :func:`node_identity` names the node a rank runs on (torchrun's ``GROUP_RANK``), so that only
  local rank 0 of each node runs the commands.

No torch and no Dagster import here: the launchers import this module too.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from campaigns.spec import DiagnosticCommand, TrainingSpec

# Variables whose values are recorded with the diagnostics (never anything else from the environment:
# an environment may hold secrets).
RECORDED_ENV = (
    "NCCL_DEBUG",
    "NCCL_DEBUG_SUBSYS",
    "NCCL_IB_HCA",
    "NCCL_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)
MAX_OUTPUT_CHARS = 200_000


def distributed_env(training: TrainingSpec) -> dict[str, str]:
    """NCCL / torch.distributed variables to export to every rank (only those the campaign sets)."""
    return training.distributed_env.env()


def node_identity() -> dict[str, Any]:
    """Node index, local rank and host of this process (torchrun's environment; a world of one without it)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank = int(os.environ.get("RANK", "0"))
    local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    node = int(os.environ.get("GROUP_RANK", rank // local_world))
    return {"node": node, "local_rank": local_rank, "rank": rank, "host": socket.gethostname()}


def _run_one(cmd: DiagnosticCommand) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": cmd.name,
        "command": " ".join(cmd.command),
        "timeout_s": cmd.timeout_s,
        "status": "ok",
        "returncode": None,
        "seconds": 0.0,
        "note": "",
        "output": "",
    }
    exe = shutil.which(cmd.command[0])
    if exe is None:
        row["status"] = "missing"
        row["note"] = f"`{cmd.command[0]}` is not installed on this node (not on PATH); skipped"
        return row
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            [exe, *cmd.command[1:]],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=cmd.timeout_s,
            stdin=subprocess.DEVNULL,
        )
        row["returncode"] = done.returncode
        row["output"] = done.stdout + (f"\n--- stderr ---\n{done.stderr}" if done.stderr.strip() else "")
        if done.returncode != 0:
            row["status"] = "failed"
            last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [""]
            row["note"] = f"exited with code {done.returncode}: {last[0][:200]}"
    except subprocess.TimeoutExpired as e:
        row["status"] = "timeout"
        partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        row["output"] = partial
        row["note"] = f"did not finish within {cmd.timeout_s:g} s; killed (partial output kept)"
    except OSError as e:  # e.g. not executable
        row["status"] = "failed"
        row["note"] = f"could not start: {e}"
    row["seconds"] = round(time.perf_counter() - t0, 3)
    row["output"] = row["output"][:MAX_OUTPUT_CHARS]
    return row


def run_commands(commands: list[DiagnosticCommand]) -> list[dict[str, Any]]:
    """Run every command concurrently; one result row per command, in the declared order."""
    if not commands:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(commands))) as pool:
        return list(pool.map(_run_one, commands))


def collect(training: TrainingSpec) -> dict[str, Any]:
    """This node's diagnostics: identity, the recorded distributed settings, and every command's result."""
    spec = training.diagnostics
    results = run_commands(list(spec.commands)) if spec.enabled else []
    return {**node_identity(), "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}, "commands": results}


def write(nodes: list[dict[str, Any]], out_dir: Path) -> list[dict[str, Any]]:
    """Save each node's command outputs as ``node<N>/<name>.txt``; return the index without the outputs."""
    index = []
    for node in nodes:
        d = out_dir / f"node{node['node']}"
        d.mkdir(parents=True, exist_ok=True)
        rows = []
        for r in node["commands"]:
            row = {k: v for k, v in r.items() if k != "output"}
            if r["status"] != "missing":
                f = d / f"{r['name']}.txt"
                f.write_text(
                    f"$ {r['command']}\n# status {r['status']}"
                    + (f" ({r['note']})" if r["note"] else "")
                    + f", {r['seconds']} s\n\n{r['output']}"
                )
                row["file"] = str(f)
            rows.append(row)
        index.append({k: v for k, v in node.items() if k != "commands"} | {"commands": rows})
    return index


def summary_line(index: list[dict[str, Any]]) -> str:
    """One line per run: how many commands ran, and which were skipped or failed where."""
    parts = []
    for node in index:
        by: dict[str, list[str]] = {}
        for r in node["commands"]:
            by.setdefault(r["status"], []).append(r["name"])
        parts.append(
            f"node {node['node']} ({node['host']}): "
            + ", ".join(f"{k} {len(v)} [{', '.join(v)}]" for k, v in sorted(by.items()))
        )
    return "; ".join(parts) if parts else "no diagnostics"
