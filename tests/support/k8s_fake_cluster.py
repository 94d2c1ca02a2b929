"""A Kubernetes API emulated by ``kmock`` (a real HTTP server on 127.0.0.1) plus a tiny fake
kubelet / job controller, so the launcher's whole lifecycle runs against real HTTP calls.

``kmock.KubernetesEmulator`` stores objects and serves create / get / list / patch / delete /
watch; it has no controllers. ``FakeKubelet`` plays them: for each Job (or PyTorchJob) it creates
one pod per node with the labels and annotations the real controllers add, resolves the pod's
environment the way the kubelet does (plain values, ``secretKeyRef`` from the emulated Secrets,
the completion-index ``fieldRef``), runs a *program* per pod that emits log lines, then writes the
container's terminated state, the pod phase and the Job's conditions. When the Job is deleted its
pods are garbage-collected. Pod logs are served from ``/api/v1/namespaces/NS/pods/NAME/log``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import kmock
import yaml

from tests.support import REPO_ROOT

NS = "training"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class EmulatedApiServer:
    """kmock's Kubernetes emulator on a background event loop; pod logs kept here, thread-safe."""

    def __init__(self):
        self.logs: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._seq = 0
        self.url = ""
        self.handler = None

    # --------------------------------------------------------------- logs
    def append_log(self, pod: str, text: str) -> None:
        with self._lock:
            self._seq += 1
            now = time.time()
            frac = f"{int((now % 1) * 1e6):06d}{self._seq % 1000:03d}".rstrip("0") or "0"
            ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{frac}Z"
            self.logs.setdefault(pod, []).append(f"{ts} {text}")

    def _serve_log(self, req) -> bytes:
        with self._lock:
            lines = list(self.logs.get(req.name, []))
        if req.params.get("timestamps", "").lower() != "true":
            lines = [ln.split(" ", 1)[1] for ln in lines]
        if req.params.get("tailLines"):
            lines = lines[-int(req.params["tailLines"]) :]
        return "".join(ln + "\n" for ln in lines).encode()

    # --------------------------------------------------------------- server
    def __enter__(self) -> EmulatedApiServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("kmock did not start")
        return self

    async def _main(self) -> None:
        async with kmock.KubernetesEmulator() as k, kmock.Server(k) as srv:
            for res in (
                "v1/pods",
                "v1/services",
                "v1/secrets",
                "batch/v1/jobs",
                "kubeflow.org/v1/pytorchjobs",
                "ray.io/v1/rayjobs",
            ):
                k.resources[res] = {}
            k[kmock.resource("v1/pods"), kmock.subresource("log")] << self._serve_log
            self.handler, self.url = k, str(srv.url).rstrip("/")
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            await self._stop.wait()

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "kmock",
                    "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                    "users": [{"name": "kmock", "user": {"token": "not-a-real-token"}}],
                    "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
                }
            )
        )
        return path

    def api(self):
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)


# --------------------------------------------------------------------------- pods


@dataclass
class PodRun:
    """What a program sees: its index, resolved environment and command, a way to log, a stop flag."""

    server: EmulatedApiServer
    pod: str
    index: int
    env: dict[str, str]
    command: list[str]
    stopped: threading.Event = field(default_factory=threading.Event)

    def emit(self, line: str) -> None:
        self.server.append_log(self.pod, line)

    @property
    def config_file(self) -> str:
        return self.command[self.command.index("--config") + 1]


# A program returns (exit code, terminated reason) when its "container" ends.
Program = Callable[[PodRun], tuple[int, str]]


def python_program(source: str, timeout_s: float = 60) -> Program:
    """Run ``python -c source CONFIG_FILE`` with the pod's resolved environment; its output is the pod log."""

    def run(p: PodRun) -> tuple[int, str]:
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO_ROOT), **p.env}
        proc = subprocess.Popen(
            [sys.executable, "-c", source, p.config_file],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def pump():
            for line in proc.stdout:
                p.emit(line.rstrip("\n"))

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if p.stopped.is_set() or time.monotonic() > deadline:
                proc.terminate()
                proc.wait(10)
                t.join(5)
                return 143, "Error"
            time.sleep(0.02)
        t.join(5)
        return proc.returncode, "Completed" if proc.returncode == 0 else "Error"

    return run


def scripted_program(
    lines: list[str], exit_code: int = 0, reason: str | None = None, delay_s: float = 0.0, run_s: float = 0.0
) -> Program:
    """Emit ``lines``, stay up ``run_s`` seconds (or until stopped), then exit."""

    def run(p: PodRun) -> tuple[int, str]:
        for line in lines:
            if p.stopped.wait(delay_s):
                return 143, "Error"
            p.emit(line)
        if p.stopped.wait(run_s):
            return 143, "Error"
        return exit_code, reason or ("Completed" if exit_code == 0 else "Error")

    return run


class FakeKubelet:
    """Job / PyTorchJob controller and kubelet for one namespace, over the emulated API."""

    def __init__(
        self,
        server: EmulatedApiServer,
        programs: Callable[[int, int], Program],
        namespace: str = NS,
        start_delay_s: float = 0.05,
        pending: dict[int, dict] | None = None,
    ):
        from kubernetes import client

        self.server, self.programs, self.ns = server, programs, namespace
        api = server.api()
        self.core, self.batch, self.custom = client.CoreV1Api(api), client.BatchV1Api(api), client.CustomObjectsApi(api)
        self.start_delay_s = start_delay_s
        self.reconcile_s = 0.03  # between two looks at the API (a test with real work to run may look less often)
        self.pending = pending or {}  # index -> pod status to keep (e.g. unschedulable) instead of running
        self.jobs: dict[str, dict] = {}  # name -> {"kind", "pods": [...], "runs": [...], "results": {}}
        self.created: list[dict] = []  # every workload object seen, as created
        self.events: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> FakeKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for j in self.jobs.values():
            for r in j["runs"]:
                r.stopped.set()
        self._thread.join(10)

    def wait_all_deleted(self, timeout_s: float = 5.0) -> bool:
        """True once every workload seen was deleted and its pods garbage-collected."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.jobs and all(j.get("gone") for j in self.jobs.values()):
                return True
            time.sleep(0.02)
        return False

    # --------------------------------------------------------------- helpers
    def _secret_value(self, name: str, key: str) -> str | None:
        try:
            s = self.core.read_namespaced_secret(name, self.ns)
        except Exception:
            return None
        raw = (s.data or {}).get(key)
        return base64.b64decode(raw).decode() if raw is not None else None

    def _resolve_env(self, container: dict, annotations: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            elif "secretKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["secretKeyRef"]
                v = self._secret_value(ref["name"], ref["key"])
                if v is None and not ref.get("optional"):
                    raise LookupError(f'secret "{ref["name"]}" not found')
                if v is not None:
                    env[e["name"]] = v
            elif "fieldRef" in e.get("valueFrom", {}):
                path = e["valueFrom"]["fieldRef"]["fieldPath"]
                key = path.split("['", 1)[1].rstrip("']") if "['" in path else path
                env[e["name"]] = annotations.get(key, "")
        return env

    def _patch_pod(self, name: str, status: dict) -> None:
        self.core.patch_namespaced_pod_status(name, self.ns, {"status": status})

    # --------------------------------------------------------------- controller loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._reconcile()
            except Exception as e:  # keep the fake cluster alive; the test sees the effect
                self.events.append(f"reconcile error: {e!r}")
            self._stop.wait(self.reconcile_s)

    def _workloads(self) -> list[dict]:
        jobs = json.loads(self.batch.list_namespaced_job(self.ns, _preload_content=False).data)["items"]
        pts = self.custom.list_namespaced_custom_object("kubeflow.org", "v1", self.ns, "pytorchjobs").get("items", [])
        return jobs + pts

    def _reconcile(self) -> None:
        live = {}
        for obj in self._workloads():
            name = obj["metadata"]["name"]
            live[name] = obj
            if name not in self.jobs:
                self.created.append(obj)
                self._start(obj)
        for name, j in list(self.jobs.items()):
            if name not in live and not j.get("gone"):  # deleted: garbage-collect the pods
                j["gone"] = True
                self.events.append(f"deleted {name}")
                for r in j["runs"]:
                    r.stopped.set()
                for pod in j["pods"]:
                    try:
                        self.core.delete_namespaced_pod(pod, self.ns)
                    except Exception:
                        pass
            elif name in live and not j.get("gone"):
                self._update_job(name, j, live[name])

    def _pod_templates(self, obj: dict) -> list[tuple[int, dict, dict]]:
        """(node index, pod template, extra labels) per pod to create."""
        if obj["kind"] == "Job":
            n = obj["spec"]["completions"]
            return [
                (
                    i,
                    obj["spec"]["template"],
                    {
                        "batch.kubernetes.io/job-completion-index": str(i),
                        "batch.kubernetes.io/job-name": obj["metadata"]["name"],
                    },
                )
                for i in range(n)
            ]
        out = []
        reps = obj["spec"]["pytorchReplicaSpecs"]
        for i in range(reps["Master"]["replicas"]):
            out.append(
                (
                    0,
                    reps["Master"]["template"],
                    {"training.kubeflow.org/replica-type": "master", "training.kubeflow.org/replica-index": str(i)},
                )
            )
        for i in range(reps.get("Worker", {}).get("replicas", 0)):
            out.append(
                (
                    i + 1,
                    reps["Worker"]["template"],
                    {"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": str(i)},
                )
            )
        return out

    def _start(self, obj: dict) -> None:
        name = obj["metadata"]["name"]
        pods, runs = [], []
        templates = self._pod_templates(obj)
        self.jobs[name] = {"kind": obj["kind"], "pods": pods, "runs": runs, "results": {}, "n": len(templates)}
        for index, tpl, extra in templates:
            pod_name = f"{name}-{index}-{os.urandom(3).hex()[:5]}"
            labels = {**tpl["metadata"].get("labels", {}), **extra}
            ann = {**tpl["metadata"].get("annotations", {})}
            spec = json.loads(json.dumps(tpl["spec"]))
            if obj["kind"] == "Job":
                ann["batch.kubernetes.io/job-completion-index"] = str(index)
            else:  # the training operator injects the rendezvous variables into every replica
                port = next(
                    p["containerPort"] for p in spec["containers"][0].get("ports", []) if p["name"] == "pytorchjob-port"
                )
                spec["containers"][0]["env"] = spec["containers"][0].get("env", []) + [
                    {"name": "MASTER_ADDR", "value": f"{name}-master-0"},
                    {"name": "MASTER_PORT", "value": str(port)},
                    {"name": "WORLD_SIZE", "value": str(len(templates))},
                    {"name": "RANK", "value": str(index)},
                ]
            self.core.create_namespaced_pod(
                self.ns,
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod_name, "namespace": self.ns, "labels": labels, "annotations": ann},
                    "spec": spec,
                },
            )
            pods.append(pod_name)
            threading.Thread(
                target=self._run_pod, args=(name, index, pod_name, {"spec": spec}, ann), daemon=True
            ).start()

    def _run_pod(self, job: str, index: int, pod: str, tpl: dict, ann: dict) -> None:
        time.sleep(self.start_delay_s)
        if index in self.pending:
            self._patch_pod(pod, self.pending[index])
            return
        c = tpl["spec"]["containers"][0]
        try:
            env = self._resolve_env(c, ann)
        except LookupError as e:
            self._patch_pod(
                pod,
                {
                    "phase": "Pending",
                    "containerStatuses": [
                        {
                            "name": c["name"],
                            "ready": False,
                            "restartCount": 0,
                            "image": c["image"],
                            "imageID": "",
                            "state": {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}},
                        }
                    ],
                },
            )
            return
        run = PodRun(self.server, pod, index, env, c["command"])
        self.jobs[job]["runs"].append(run)
        self._patch_pod(
            pod,
            {
                "phase": "Running",
                "startTime": _now(),
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "ready": True,
                        "restartCount": 0,
                        "image": c["image"],
                        "imageID": "",
                        "state": {"running": {"startedAt": _now()}},
                    }
                ],
            },
        )
        code, reason = self.programs(index, self.jobs[job]["n"])(run)
        if self.jobs[job].get("gone"):
            return
        try:
            self._patch_pod(
                pod,
                {
                    "phase": "Succeeded" if code == 0 else "Failed",
                    "containerStatuses": [
                        {
                            "name": c["name"],
                            "ready": False,
                            "restartCount": 0,
                            "image": c["image"],
                            "imageID": "",
                            "state": {
                                "terminated": {
                                    "exitCode": code,
                                    "reason": reason,
                                    "startedAt": _now(),
                                    "finishedAt": _now(),
                                }
                            },
                        }
                    ],
                },
            )
        except Exception:
            return
        self.jobs[job]["results"][index] = code

    def _update_job(self, name: str, j: dict, obj: dict) -> None:
        if j.get("done"):
            return
        res = j["results"]
        failed = [i for i, c in res.items() if c != 0]
        if failed:
            j["done"] = True
            time.sleep(0.2)  # the real controller reacts after the pod status, not with it
            cond = {
                "type": "Failed",
                "status": "True",
                "reason": "PodFailurePolicy",
                "message": f"Container trainer for pod {name}-{failed[0]} failed with exit code {res[failed[0]]}",
            }
            self._set_status(j["kind"], name, {"failed": len(failed), "conditions": [cond]})
        elif len(res) == j["n"]:
            j["done"] = True
            ok = "Complete" if j["kind"] == "Job" else "Succeeded"
            self._set_status(
                j["kind"],
                name,
                {
                    "succeeded": j["n"],
                    "conditions": [
                        {
                            "type": ok,
                            "status": "True",
                            "reason": "CompletionsReached" if ok == "Complete" else "JobSucceeded",
                        }
                    ],
                },
            )

    def _set_status(self, kind: str, name: str, status: dict) -> None:
        if kind == "Job":
            self.batch.patch_namespaced_job_status(name, self.ns, {"status": status})
        else:
            self.custom.patch_namespaced_custom_object_status(
                "kubeflow.org", "v1", self.ns, "pytorchjobs", name, {"status": status}
            )
