"""One launch on Kubernetes from creation to clean-up, the part both launchers share: training's
(:class:`~resources.k8s.launcher.K8sTrainingLauncher`: an Indexed Job and its Service, or a PyTorchJob) and the
generation stages' (:class:`~resources.k8s.kuberay_launcher.KubeRayJobLauncher`: a RayJob).

:func:`pipes_session` opens the Dagster Pipes session whose messages are read from the pods' logs
(:class:`~resources.k8s.logs.PodLogsMessageReader`). :meth:`WorkloadWatch.launch` creates the workload, watches it,
waits for the last log lines, and deletes it when the launch fails, is stopped (its budget, a cancelled run) or, with
``delete_on_success``, succeeds. The watch (:meth:`WorkloadWatch.watch`) polls the workload and its pods every
``poll_interval_s``:

- a pod that started has its log followed, one that finished is marked so;
- a pod that can never succeed (OOMKilled, a non-zero exit, an eviction, a missing Secret) fails the launch at once
  with its reason and last log lines (:meth:`WorkloadWatch.pod_failure`), without waiting for the others;
- a pod that waits (unschedulable, an image that cannot be pulled) is reported once and fails the launch after
  ``pending_timeout_s`` or ``image_pull_timeout_s``;
- the new Pipes custom messages are streamed (metrics, usage charged to the budget guard);
- the workload's state ends the watch (succeeded: the last logs followed; failed), then the budget guard and the
  overall ``timeout_s`` are checked;
- failed API reads are tolerated ``api_error_budget`` times in a row (the guard still checked: the pods keep
  spending while the API is away).

What differs (which pods, whose logs, which messages, the words of each message) is in each launcher's subclass of
:class:`WorkloadWatch`. The settings are the launcher's (:class:`~resources.k8s.connection.KubernetesLauncher`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dagster import Failure, MetadataValue, PipesEnvContextInjector, open_pipes_session

from resources.k8s.logs import PodLogsMessageReader
from resources.k8s.status import PodProblem, pod_finished, pod_name, pod_problem, pod_started

IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff")  # waits limited by image_pull_timeout_s


@contextmanager
def pipes_session(
    launcher, context, core, namespace: str, workdir: Path, container: str, extras: dict[str, Any]
) -> Iterator[tuple[Any, PodLogsMessageReader]]:
    """A Pipes session (its context in the pods' environment) whose messages and log lines are read from the logs of
    ``container`` in the launch's pods; yields ``(session, reader)``."""
    reader = PodLogsMessageReader(
        core,
        namespace,
        workdir,
        container,
        tail_lines=launcher.log_tail_lines,
        reconnect_s=min(1.0, launcher.poll_interval_s),
        echo=launcher.echo_logs,
    )
    with open_pipes_session(
        context=context, context_injector=PipesEnvContextInjector(), message_reader=reader, extras=extras
    ) as session:
        yield session, reader


def list_pods(core, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
    """The pods of ``namespace`` carrying every label of ``selector``."""
    resp = core.list_namespaced_pod(
        namespace, label_selector=",".join(f"{k}={v}" for k, v in selector.items()), _preload_content=False
    )
    pods = json.loads(resp.data).get("items", [])
    # the selector again, client-side: never act on a pod of another launch
    return [
        p for p in pods if all((p.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in selector.items())
    ]


def pipes_metadata(results) -> dict[str, Any]:
    """The metadata of the Pipes session's reported results, merged."""
    out: dict[str, Any] = {}
    for r in results:
        out.update(getattr(r, "metadata", None) or {})
    return out


class WorkloadWatch:
    """One launch's workload, from creation to clean-up. ``launcher``: the launcher whose settings apply (polling,
    limits, timeout, log tail, deletion); ``reader``/``session``: the launch's Pipes session (:func:`pipes_session`);
    ``name``, ``namespace``: the workload's. A launcher subclasses it with what differs: the hooks below."""

    title = "workload"  # how the timeout names the workload ("training job NAME", "RayJob NAME")
    drain_warning = "some pod logs were still streaming when the workload finished; logs may be cut"

    def __init__(self, launcher, context, core, reader: PodLogsMessageReader, session, name: str, namespace: str):
        self.launcher, self.context, self.core = launcher, context, core
        self.reader, self.session = reader, session
        self.name, self.namespace = name, namespace

    # ------------------------------------------------------------------ hooks
    def create(self) -> None:
        """Create the workload's objects (and say what was created)."""
        raise NotImplementedError

    def delete(self, why: str) -> None:
        """Delete what :meth:`create` created; never raises (a warning names what could not be deleted)."""
        raise NotImplementedError

    def read(self) -> tuple[dict[str, Any], list[tuple[dict[str, Any], str | None]]]:
        """The workload object and its pods, each with its role (None where pods have none)."""
        raise NotImplementedError

    def state(self, obj: dict[str, Any]) -> tuple[str, str]:
        """``(running | succeeded | failed, why)`` of the workload object."""
        raise NotImplementedError

    def stream(self, seen: int) -> int:
        """Handle the session's custom messages after the first ``seen``; returns how many there are."""
        raise NotImplementedError

    def check_budget(self) -> None:
        """Check the budget guard; its stop propagates (and :meth:`launch` deletes the workload)."""

    def failed(self, obj: dict[str, Any], pods: list[tuple[dict[str, Any], str | None]], why: str) -> Failure:
        """The failure of a workload that failed without a pod to blame."""
        raise NotImplementedError

    def failure_words(self, problem: PodProblem, role: str | None) -> tuple[str, str, dict[str, Any]]:
        """How :meth:`pod_failure` says it: ``(subject, what was stopped, metadata naming the pod's node or role)``."""
        raise NotImplementedError

    def ids(self) -> dict[str, Any]:
        """The metadata naming the workload and its namespace."""
        raise NotImplementedError

    def container(self, role: str | None) -> str:
        """The container whose log a failed pod's last lines come from."""
        return self.reader.container

    def followed(self, role: str | None) -> bool:
        """Whether the logs of a pod of this role are followed."""
        return True

    def node(self, pod: dict[str, Any]) -> int | None:
        """The node index a pod's log lines are filed under (None: the pod's name only)."""
        return None

    def who(self, role: str | None) -> str:
        """How a waiting pod's report names its role (a prefix)."""
        return ""

    def tolerated(self, pod: dict[str, Any], problem: PodProblem, role: str | None) -> str | None:
        """A warning for a fatal pod problem the launch survives, reported once per pod and exit code (None: the
        problem fails the launch)."""
        return None

    def label(self) -> str:
        """How a lost API names the workload."""
        return self.name

    def kind(self, obj: dict[str, Any]) -> str:
        """How the success message names the workload's kind."""
        return obj.get("kind", "workload")

    # ------------------------------------------------------------------ the shared part
    def launch(self) -> dict[str, Any]:
        """Create the workload, watch it to its end and wait for the last log lines; delete it when the launch
        fails, is stopped or cancelled (an interrupt), and when it succeeds unless ``delete_on_success`` is off.
        Returns the Pipes session's result metadata."""
        try:
            self.create()
            self.watch()
            if not self.reader.join(self.launcher.log_drain_timeout_s):
                self.context.log.warning(self.drain_warning)
        except BaseException as exc:  # failure, timeout, budget stop, or the Dagster run was cancelled (interrupt)
            self.reader.stop()
            self.delete(why=type(exc).__name__)
            raise
        if self.launcher.delete_on_success:
            self.delete(why="succeeded")
        return pipes_metadata(self.session.get_results())

    def watch(self) -> None:
        """Poll the workload and its pods until it succeeds; raise the failure that stops it."""
        s, log = self.launcher, self.context.log
        start = time.monotonic()
        deadline = start + s.timeout_s
        slow_since: dict[tuple[str, str], float] = {}
        reported: set[tuple[str, str]] = set()
        n_custom, api_errors = 0, 0
        while True:
            try:
                obj, pods = self.read()
                api_errors = 0
            except Exception as e:
                api_errors += 1
                if api_errors > s.api_error_budget:
                    raise Failure(f"lost the Kubernetes API while following {self.label()}: {e}") from e
                log.warning(f"Kubernetes API read failed ({api_errors}/{s.api_error_budget}): {e}")
                self.check_budget()  # the pods keep spending while the API is away
                time.sleep(s.poll_interval_s)
                continue
            now = time.monotonic()
            for pod, role in pods:
                name = pod_name(pod)
                if self.followed(role):
                    if pod_started(pod):
                        self.reader.follow(name, self.node(pod))
                    if pod_finished(pod):
                        self.reader.mark_finished(name)
                problem = pod_problem(pod)
                if problem is None:
                    continue
                note = self.tolerated(pod, problem, role)
                if note is not None:
                    key = (name, f"exit-{problem.exit_code}")
                    if key not in reported:
                        reported.add(key)
                        log.warning(note)
                    continue
                if problem.fatal:
                    raise self.pod_failure(problem, role)
                key = (name, problem.reason)
                first = slow_since.setdefault(key, now)
                limit = s.image_pull_timeout_s if problem.reason in IMAGE_PULL_REASONS else s.pending_timeout_s
                if key not in reported:
                    reported.add(key)
                    log.warning(f"waiting: {self.who(role)}{problem.describe()}")
                if now - first > limit:
                    raise self.pod_failure(problem, role, waited_s=now - first)
            n_custom = self.stream(n_custom)
            state, why = self.state(obj)
            if state == "succeeded":
                for pod, role in pods:  # a pod that finished between two polls
                    if self.followed(role):
                        self.reader.follow(pod_name(pod), self.node(pod))
                log.info(f"{self.kind(obj)} {self.name} succeeded ({why}) after {now - start:.0f}s")
                self.stream(n_custom)
                return
            if state == "failed":
                raise self.failed(obj, pods, why)
            self.check_budget()
            if now > deadline:
                raise Failure(f"{self.title} {self.name} exceeded the launcher timeout ({s.timeout_s:.0f}s); stopped")
            time.sleep(s.poll_interval_s)

    def pod_failure(self, problem: PodProblem, role: str | None, waited_s: float | None = None) -> Failure:
        """The failure of a launch stopped by one pod: ``"{subject} {problem}{waited}; {stopped}"`` and the pod's last
        log lines, with metadata ``pod``, its node or role, ``reason``, ``exit_code``, the workload's :meth:`ids` and
        ``last_lines`` (:meth:`failure_words`: this launcher's words)."""
        n = self.launcher.log_tail_lines
        # The failed container's log is complete: ask the API for its end (the follower thread may not have read the
        # last lines yet); fall back to what the follower has when the API cannot answer.
        try:
            text = self.core.read_namespaced_pod_log(
                problem.pod, self.namespace, container=self.container(role), tail_lines=n, _preload_content=False
            ).data
            lines = text.decode("utf-8", errors="replace").splitlines()
        except Exception:
            lines = []
        lines = lines or self.reader.tail(problem.pod)
        waited = f" (waited {waited_s:.0f}s)" if waited_s is not None else ""
        tail = "\n".join(lines[-n:]) or "(no log lines)"
        subject, stopped, about = self.failure_words(problem, role)
        return Failure(
            description=f"{subject} {problem.describe()}{waited}; {stopped}\nlast log lines of {problem.pod}:\n{tail}",
            metadata={
                "pod": problem.pod,
                **about,
                "reason": problem.reason,
                "exit_code": problem.exit_code if problem.exit_code is not None else -1,
                **self.ids(),
                "last_lines": MetadataValue.md(f"```\n{tail}\n```"),
            },
        )
