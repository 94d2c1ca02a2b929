"""A fake KubeRay operator (and kubelet) for RayJobs over the emulated Kubernetes API (``k8s_fake_cluster``).

For each ``RayJob`` it does what KubeRay v1.1 does in ``K8sJobMode``, as far as the launcher can see: a Ray
cluster named ``<rayjob>-<5 chars>`` (``status.rayClusterName``) with a head pod and ``replicas`` worker pods
built from the job's pod templates (their labels plus ``ray.io/cluster``, ``ray.io/node-type``,
``ray.io/group``), each pod's environment resolved as the kubelet does (``secretKeyRef`` from the emulated
Secrets: a missing one leaves the pod in ``CreateContainerConfigError``); once the head runs, a submitter pod
(container ``ray-job-submitter``, labels ``batch.kubernetes.io/job-name`` / ``job-name`` = the RayJob's name) whose
log is the job's log. The *driver* program runs with the head's environment plus the job's ``runtimeEnvYAML``
``env_vars`` (as the Ray job driver on the head does) and its output becomes the submitter's log. When it
exits, the RayJob's status says ``SUCCEEDED`` / ``FAILED`` (``jobDeploymentStatus`` Complete / Failed) and, with
``shutdownAfterJobFinishes``, the cluster's pods are deleted. A deleted RayJob takes its pods with it (KubeRay's
owner references). With ``clusterSelector`` (a long-lived RayCluster) only the submitter pod is created.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import yaml

from tests.support import REPO_ROOT
from tests.support.k8s_fake_cluster import NS, FakeKubelet, PodRun, Program, _now

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"


def driver_program(source: str, timeout_s: float = 60) -> Program:
    """Run ``python -c source --job JOB.json ...`` (the entrypoint's arguments) with the driver's environment; its
    output is the submitter pod's log."""

    def run(p: PodRun) -> tuple[int, str]:
        args = p.command[p.command.index("--job") :]
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO_ROOT), **p.env}
        proc = subprocess.Popen(
            [sys.executable, "-c", source, *args],
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


class FakeKubeRayOperator(FakeKubelet):
    """KubeRay's RayJob controller plus the kubelet of the pods it creates, for one namespace."""

    def __init__(
        self,
        server,
        driver: Program,
        namespace: str = NS,
        pending: dict[str, dict] | None = None,
        crash_workers: dict[int, str] | None = None,
    ):
        super().__init__(server, programs=lambda index, n: driver, namespace=namespace)
        self.driver = driver
        self.ray_pending = pending or {}  # "head" | "worker-<i>" -> a pod status to keep instead of running
        self.crash_workers = crash_workers or {}  # worker index -> a log line it prints before exiting 137 (OOMKilled)
        self.ray_pods: dict[str, list[dict]] = {}  # RayJob name -> pods created for it, with their role

    # --------------------------------------------------------------- controller loop
    def _reconcile(self) -> None:
        live = {
            o["metadata"]["name"]: o
            for o in self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL).get("items", [])
        }
        for name, obj in live.items():
            if name not in self.jobs:
                self.created.append(obj)
                self._start(obj)
        for name, j in list(self.jobs.items()):
            if name not in live and not j.get("gone"):  # deleted: the owner references take every pod
                j["gone"] = True
                self.events.append(f"deleted {name}")
                for r in j["runs"]:
                    r.stopped.set()
                self._delete_pods(j["pods"])

    def _delete_pods(self, pods: list[str]) -> None:
        for pod in pods:
            try:
                self.core.delete_namespaced_pod(pod, self.ns)
            except Exception:
                pass

    def _status(self, name: str, status: dict) -> None:
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, self.ns, PLURAL, name, {"status": status})

    def _start(self, obj: dict) -> None:
        name = obj["metadata"]["name"]
        spec = obj["spec"]
        self.jobs[name] = {"kind": "RayJob", "pods": [], "runs": [], "results": {}, "n": 0, "ray_pods": []}
        cluster = f"{name}-{os.urandom(3).hex()[:5]}"
        self._status(name, {"jobDeploymentStatus": "Initializing", "rayClusterName": cluster})
        head_env: dict[str, str] = {}
        if "rayClusterSpec" in spec:
            rc = spec["rayClusterSpec"]
            head_ready = threading.Event()
            self._ray_pod(name, cluster, "head", rc["headGroupSpec"]["template"], head_ready, head_env)
            for group in rc.get("workerGroupSpecs", []):
                for i in range(group.get("replicas", 0)):
                    self._ray_pod(name, cluster, f"worker-{i}", group["template"], None, None, group["groupName"])
            threading.Thread(target=self._submit, args=(name, spec, head_ready, head_env), daemon=True).start()
        else:  # a long-lived RayCluster: its pods exist already; the job only gets a submitter
            ready = threading.Event()
            ready.set()
            threading.Thread(target=self._submit, args=(name, spec, ready, head_env), daemon=True).start()

    def _ray_pod(
        self,
        job: str,
        cluster: str,
        role: str,
        tpl: dict,
        ready: threading.Event | None,
        env_out: dict | None,
        group: str = "headgroup",
    ) -> None:
        node_type = "head" if role == "head" else "worker"
        pod = f"{cluster}-{'head' if role == 'head' else group + '-worker'}-{os.urandom(3).hex()[:5]}"
        labels = {
            **tpl["metadata"].get("labels", {}),
            "ray.io/cluster": cluster,
            "ray.io/node-type": node_type,
            "ray.io/group": group,
        }
        self.core.create_namespaced_pod(
            self.ns,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod, "namespace": self.ns, "labels": labels},
                "spec": tpl["spec"],
            },
        )
        self.jobs[job]["pods"].append(pod)
        self.jobs[job]["ray_pods"].append(pod)
        threading.Thread(target=self._run_ray_pod, args=(job, role, pod, tpl, ready, env_out), daemon=True).start()

    def _run_ray_pod(self, job: str, role: str, pod: str, tpl: dict, ready, env_out) -> None:
        time.sleep(self.start_delay_s)
        c = tpl["spec"]["containers"][0]
        if role in self.ray_pending:
            self._patch_pod(pod, self.ray_pending[role])
            return
        try:
            env = self._resolve_env(c, {})
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
        if env_out is not None:
            env_out.update(env)
        if ready is not None:
            ready.set()
        index = int(role.split("-")[1]) if role.startswith("worker-") else None
        if index in self.crash_workers:  # the worker dies mid-stage; Ray retries its shards on the others
            time.sleep(0.3)
            self.server.append_log(pod, self.crash_workers[index])
            self._patch_pod(
                pod,
                {
                    "phase": "Failed",
                    "containerStatuses": [
                        {
                            "name": c["name"],
                            "ready": False,
                            "restartCount": 0,
                            "image": c["image"],
                            "imageID": "",
                            "state": {
                                "terminated": {
                                    "exitCode": 137,
                                    "reason": "OOMKilled",
                                    "startedAt": _now(),
                                    "finishedAt": _now(),
                                }
                            },
                        }
                    ],
                },
            )

    def _submit(self, name: str, spec: dict, head_ready: threading.Event, head_env: dict) -> None:
        while not head_ready.wait(0.02):  # KubeRay creates the submitter once the head is ready
            if self._stop.is_set() or self.jobs[name].get("gone"):
                return
        if self.jobs[name].get("gone"):
            return
        pod = f"{name}-{os.urandom(3).hex()[:5]}"
        labels = {"batch.kubernetes.io/job-name": name, "job-name": name}
        image = "the head's image"
        self.core.create_namespaced_pod(
            self.ns,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod, "namespace": self.ns, "labels": labels},
                "spec": {"containers": [{"name": "ray-job-submitter", "image": image}], "restartPolicy": "Never"},
            },
        )
        self.jobs[name]["pods"].append(pod)
        self._status(name, {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})
        runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}
        env = {**head_env, **{k: str(v) for k, v in (runtime_env.get("env_vars") or {}).items()}}
        run = PodRun(self.server, pod, 0, env, spec["entrypoint"].split())
        self.jobs[name]["runs"].append(run)
        status = {"name": "ray-job-submitter", "ready": True, "restartCount": 0, "image": image, "imageID": ""}
        self._patch_pod(
            pod,
            {
                "phase": "Running",
                "startTime": _now(),
                "containerStatuses": [status | {"state": {"running": {"startedAt": _now()}}}],
            },
        )
        code, reason = self.driver(run)
        if self.jobs[name].get("gone"):
            return
        self.jobs[name]["results"][0] = code
        try:
            self._patch_pod(
                pod,
                {
                    "phase": "Succeeded" if code == 0 else "Failed",
                    "containerStatuses": [
                        status
                        | {
                            "ready": False,
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
            ok = code == 0
            self._status(
                name,
                {
                    "jobDeploymentStatus": "Complete" if ok else "Failed",
                    "jobStatus": "SUCCEEDED" if ok else "FAILED",
                    "message": "" if ok else f"Job failed: the driver exited with code {code}",
                },
            )
        except Exception:
            return
        if spec.get("shutdownAfterJobFinishes"):
            self._delete_pods(self.jobs[name]["ray_pods"])
