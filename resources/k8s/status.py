"""Read Kubernetes object status (plain dicts, as the API returns them): pure, unit-tested.

``pod_problem`` turns a pod into the reason it is stuck or dead (OOMKilled, Error, an image that
cannot be pulled, a Secret that does not exist, Unschedulable) or ``None`` when it is fine;
``workload_state`` reads a Job's or PyTorchJob's conditions.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from resources.k8s.manifests import COMPLETION_INDEX_ANNOTATION

# Waiting reasons that never resolve by themselves: fail at once.
FATAL_WAITING = {
    "CreateContainerConfigError",
    "CreateContainerError",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CrashLoopBackOff",
    "RunContainerError",
}
# Waiting reasons that may be transient (registry hiccup): fail only when they last.
SLOW_WAITING = {"ErrImagePull", "ImagePullBackOff"}


@dataclass(frozen=True)
class PodProblem:
    pod: str
    node: int | None
    reason: str  # OOMKilled, Error, ImagePullBackOff, Unschedulable, Evicted, ...
    message: str
    exit_code: int | None = None
    fatal: bool = True  # False: may resolve (Pending, image pull); the launcher applies a timeout

    def describe(self) -> str:
        where = f"pod {self.pod}" + (f" (node {self.node})" if self.node is not None else "")
        code = f", exit code {self.exit_code}" if self.exit_code is not None else ""
        msg = f": {self.message.strip()}" if self.message and self.message.strip() else ""
        return f"{where}: {self.reason}{code}{msg}"


def _get(d: dict[str, Any] | None, *path: str, default: Any = None) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d or d[p] is None:
            return default
        d = d[p]
    return d


def pod_name(pod: dict[str, Any]) -> str:
    return _get(pod, "metadata", "name", default="?")


def pod_node_index(pod: dict[str, Any]) -> int | None:
    """Node index: the Indexed Job completion index, or the PyTorchJob replica (Master 0, Worker i+1)."""
    meta = pod.get("metadata") or {}
    for source in (meta.get("annotations") or {}, meta.get("labels") or {}):
        v = source.get(COMPLETION_INDEX_ANNOTATION)
        if v is not None and str(v).isdigit():
            return int(v)
    labels = meta.get("labels") or {}
    rtype, ridx = labels.get("training.kubeflow.org/replica-type"), labels.get("training.kubeflow.org/replica-index")
    if rtype is not None and str(ridx).isdigit():
        return 0 if rtype.lower() == "master" else int(ridx) + 1
    return None


def pod_phase(pod: dict[str, Any]) -> str:
    return _get(pod, "status", "phase", default="Pending")


def pod_started(pod: dict[str, Any]) -> bool:
    """True once a container runs or ran, i.e. its log can be read."""
    for cs in _get(pod, "status", "containerStatuses", default=[]) or []:
        state = cs.get("state") or {}
        if state.get("running") or state.get("terminated"):
            return True
    return pod_phase(pod) in ("Running", "Succeeded", "Failed")


def pod_finished(pod: dict[str, Any]) -> bool:
    return pod_phase(pod) in ("Succeeded", "Failed")


def pod_problem(pod: dict[str, Any]) -> PodProblem | None:
    name, node = pod_name(pod), pod_node_index(pod)
    statuses = (_get(pod, "status", "initContainerStatuses", default=[]) or []) + (
        _get(pod, "status", "containerStatuses", default=[]) or []
    )
    for cs in statuses:
        state = cs.get("state") or {}
        term = state.get("terminated") or (_get(cs, "lastState", "terminated") if cs.get("restartCount") else None)
        if term and term.get("exitCode", 0) != 0:
            return PodProblem(
                name, node, term.get("reason") or "Error", term.get("message") or "", exit_code=term.get("exitCode")
            )
        waiting = state.get("waiting") or {}
        reason = waiting.get("reason")
        if reason in FATAL_WAITING:
            return PodProblem(name, node, reason, waiting.get("message") or "")
        if reason in SLOW_WAITING:
            return PodProblem(name, node, reason, waiting.get("message") or "", fatal=False)
    phase = pod_phase(pod)
    if phase == "Failed":
        return PodProblem(
            name, node, _get(pod, "status", "reason", default="Failed"), _get(pod, "status", "message", default="")
        )
    if phase == "Pending":
        for cond in _get(pod, "status", "conditions", default=[]) or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                return PodProblem(
                    name, node, cond.get("reason") or "Unschedulable", cond.get("message") or "", fatal=False
                )
    return None


def workload_state(obj: dict[str, Any]) -> tuple[str, str]:
    """(``running`` | ``succeeded`` | ``failed``, reason and message) of a Job or PyTorchJob."""
    conds = {
        c.get("type"): c for c in _get(obj, "status", "conditions", default=[]) or [] if str(c.get("status")) == "True"
    }
    for ok in ("Complete", "Succeeded"):
        if ok in conds:
            return "succeeded", conds[ok].get("reason") or ok
    for bad in ("Failed", "FailureTarget"):
        if bad in conds:
            c = conds[bad]
            return "failed", ": ".join(x for x in (c.get("reason"), c.get("message")) if x) or bad
    if obj.get("kind") == "Job":
        completions = _get(obj, "spec", "completions", default=1)
        if _get(obj, "status", "succeeded", default=0) >= completions:
            return "succeeded", "all indexes succeeded"
    return "running", ""


def parse_log_timestamp(ts: str) -> tuple[float, int] | None:
    """RFC 3339 (nano) timestamp of a ``timestamps=true`` log line as (epoch seconds, nanoseconds).

    Kubernetes trims trailing zeros of the fraction, so timestamps do not compare as strings.
    """
    try:
        base, _, frac = ts.rstrip("Z").partition(".")
        frac = (frac.split("+")[0].split("-")[0] + "000000000")[:9]
        secs = datetime.fromisoformat(base).replace(tzinfo=UTC).timestamp()
        return secs, int(frac)
    except ValueError:
        return None


def split_log_line(line: str) -> tuple[tuple[float, int] | None, str]:
    """``2024-01-01T00:00:00.5Z text`` -> (parsed timestamp, text); lines without one keep their text."""
    head, sep, rest = line.partition(" ")
    ts = parse_log_timestamp(head) if sep and head[:1].isdigit() and "T" in head else None
    return (ts, rest) if ts is not None else (None, line)
