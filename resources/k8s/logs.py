"""Dagster Pipes over pod logs, for a job with many pods.

Every pod gets the Pipes bootstrap environment, but only global rank 0 opens Pipes (see
``training/reporting.py``) and writes its messages as JSON lines on stderr; which pod hosts rank 0
is decided by torchrun's rendezvous, so this reader follows *every* pod's log, one thread per pod.
Pipes messages go to the session's handler (logs into the asset's event log at once, metrics and
materializations into the session); every other line goes to the node's log file, to stdout (the
step's captured logs), and into a ring buffer that supplies "last lines" when a pod fails.

A log stream that ends while its pod still runs (API timeouts, kubelet restarts) is reopened with
``sinceSeconds`` and de-duplicated by the per-line timestamps Kubernetes adds.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dagster import PipesMessageReader
from dagster_pipes import PIPES_PROTOCOL_VERSION_FIELD, PipesDefaultMessageWriter

from resources.k8s.status import split_log_line


def iter_lines(chunks: Iterator[bytes]) -> Iterator[str]:
    """Whole lines from a byte stream (a partial last line is yielded when the stream ends)."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace").rstrip("\r")
    if buf:
        yield buf.decode("utf-8", errors="replace").rstrip("\r")


class _PodLog:
    def __init__(self, pod: str, node: int | None, log_file: Path, tail_lines: int):
        self.pod, self.node, self.log_file = pod, node, log_file
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.finished = threading.Event()  # the pod terminated: stop after the current stream ends
        self.thread: threading.Thread | None = None
        self.messages = 0
        self.last_ts: tuple[float, int] | None = None


class PodLogsMessageReader(PipesMessageReader):
    """Reads Pipes messages and logs from the logs of all pods of one training launch."""

    def __init__(
        self,
        core_api: Any,
        namespace: str,
        log_dir: Path,
        container: str,
        tail_lines: int = 40,
        reconnect_s: float = 1.0,
        request_timeout_s: float = 300.0,
        echo: bool = True,
    ):
        self.core, self.namespace, self.log_dir, self.container = core_api, namespace, Path(log_dir), container
        self.tail_lines, self.reconnect_s, self.request_timeout_s, self.echo = (
            tail_lines,
            reconnect_s,
            request_timeout_s,
            echo,
        )
        self._handler = None
        self._pods: dict[str, _PodLog] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ PipesMessageReader
    @contextmanager
    def read_messages(self, handler) -> Iterator[dict[str, Any]]:
        self._handler = handler
        try:
            yield {PipesDefaultMessageWriter.STDIO_KEY: PipesDefaultMessageWriter.STDERR}
        finally:
            self.stop()
            self._handler = None

    def no_messages_debug_text(self) -> str:
        return (
            "Attempted to read Pipes messages from the logs of every training pod; only global rank 0 writes "
            "them (to stderr). Check the node logs for a trainer that failed before opening Pipes."
        )

    # ------------------------------------------------------------------ pods
    def follow(self, pod: str, node: int | None) -> None:
        """Start following a pod's log (idempotent)."""
        with self._lock:
            if pod in self._pods or self._stop.is_set():
                return
            fname = f"node-{node}.log" if node is not None else f"{pod}.log"
            p = _PodLog(pod, node, self.log_dir / fname, self.tail_lines)
            p.thread = threading.Thread(target=self._run, args=(p,), name=f"pod-logs-{pod}", daemon=True)
            self._pods[pod] = p
        p.thread.start()

    def following(self, pod: str) -> bool:
        return pod in self._pods

    def mark_finished(self, pod: str) -> None:
        if pod in self._pods:
            self._pods[pod].finished.set()

    def tail(self, pod: str) -> list[str]:
        p = self._pods.get(pod)
        return list(p.tail) if p else []

    def log_files(self) -> list[Path]:
        return [p.log_file for p in sorted(self._pods.values(), key=lambda p: (p.node is None, p.node, p.pod))]

    def messages_read(self) -> int:
        return sum(p.messages for p in self._pods.values())

    def join(self, timeout_s: float) -> bool:
        """Wait for every followed pod's log to be read to the end; True if all finished in time."""
        deadline = time.monotonic() + timeout_s
        for p in list(self._pods.values()):
            p.finished.set()
            if p.thread is not None:
                p.thread.join(max(0.0, deadline - time.monotonic()))
        return all(p.thread is None or not p.thread.is_alive() for p in self._pods.values())

    def stop(self) -> None:
        self._stop.set()
        for p in self._pods.values():
            p.finished.set()

    # ------------------------------------------------------------------ threads
    def _run(self, p: _PodLog) -> None:
        with p.log_file.open("a", encoding="utf-8") as out:
            while not self._stop.is_set():
                ended_cleanly = self._read_stream(p, out)
                if p.finished.is_set() and ended_cleanly:
                    return
                if self._stop.wait(self.reconnect_s):
                    return

    def _read_stream(self, p: _PodLog, out) -> bool:
        kwargs: dict[str, Any] = {
            "container": self.container,
            "follow": True,
            "timestamps": True,
            "_preload_content": False,
            "_request_timeout": (10, self.request_timeout_s),
        }
        if p.last_ts is not None:
            kwargs["since_seconds"] = max(1, int(time.time() - p.last_ts[0]) + 2)
        try:
            resp = self.core.read_namespaced_pod_log(p.pod, self.namespace, **kwargs)
        except Exception:  # container still creating, pod gone, API hiccup: retried by the caller
            return False
        try:
            for line in iter_lines(resp.stream(4096)):
                if self._stop.is_set():
                    return True
                ts, text = split_log_line(line)
                if ts is not None:
                    if p.last_ts is not None and ts <= p.last_ts:
                        continue  # already seen before a reconnect
                    p.last_ts = ts
                self._handle_line(p, text, out)
            return True
        except Exception:
            return False
        finally:
            resp.release_conn()

    def _handle_line(self, p: _PodLog, text: str, out) -> None:
        if text.startswith("{") and self._handler is not None:
            try:
                msg = json.loads(text)
            except ValueError:
                msg = None
            if isinstance(msg, dict) and PIPES_PROTOCOL_VERSION_FIELD in msg:
                p.messages += 1
                self._handler.handle_message(msg)
                return
        p.tail.append(text)
        out.write(text + "\n")
        out.flush()
        if self.echo:
            sys.stdout.write(f"[{p.pod}] {text}\n")
