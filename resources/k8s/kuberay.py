"""KubeRay manifests for one generation stage on Kubernetes: pure functions from the campaign to a ``RayJob``.

With ``execution.kuberay`` a generation stage (teacher generations, evaluation answers, teacher scoring)
runs as a KubeRay ``RayJob`` (``ray.io/v1``): the operator creates a Ray cluster for the job (one head pod,
``execution.replicas`` worker pods in one worker group, each worker holding one model replica with
``num_gpus_per_replica`` GPUs rounded up, as ``nvidia.com/gpu`` requests and limits), runs the entrypoint
``python -m campaign_orchestrator.generation.scaleout --job JOB.json`` on the head through a submitter pod
(``K8sJobMode``:
a Kubernetes Job that runs ``ray job submit`` and prints the job's log, so the driver's Dagster Pipes messages
reach Dagster through that pod's log, as the trainer's do), and deletes the cluster when the job ends
(``shutdownAfterJobFinishes``, ``ttlSecondsAfterFinished``). With ``execution.kuberay.ray_cluster`` the job is
submitted to that long-lived ``RayCluster`` instead (``clusterSelector``) and no cluster is created.

The pods take the campaign's ``kubernetes:`` section exactly as training's do, through the same helpers
(``manifests.pod_placement``, ``cluster_volumes``, ``secret_env``): node selector, tolerations, affinity,
priority class, service account, image pull secrets, the artifacts claim (``JOB.json`` and the generation
cache live there), ``env``, and ``secret_env`` as ``secretKeyRef`` (a Secret's value never appears in a
manifest). The Dagster Pipes bootstrap variables (no secrets) go to the driver only, through the job's
``runtimeEnvYAML``. Every object carries the ``dagster/run-id`` label, so the stale-run reaper deletes a dead
run's RayJob (``launcher.delete_run_workloads``); the operator's owner references take its cluster and
submitter with it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from campaigns.spec import CampaignSpec, KubernetesSpec
from resources.k8s import manifests as mf

RAYJOB_GROUP, RAYJOB_VERSION, RAYJOB_PLURAL = "ray.io", "v1", "rayjobs"
HEAD_CONTAINER, WORKER_CONTAINER = "ray-head", "ray-worker"
SUBMITTER_CONTAINER = "ray-job-submitter"  # the container KubeRay's submitter Job runs `ray job submit` in
WORKER_GROUP = "replicas"
COMPONENT = "ray"
RAY_CLUSTER_LABEL = "ray.io/cluster"  # KubeRay's label of a RayCluster's pods; clusterSelector matches it
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set by the Job controller on the submitter pod (also `job-name`)
ENTRYPOINT = "python -m campaign_orchestrator.generation.scaleout --job {job_file} --summary {summary_file}"
SUMMARY_FILE = "ray_summary.json"  # beside JOB.json: the job's summary (rows, tokens, shards, nodes, lost workers)
HEAD_DEFAULTS = {"cpu": "2", "memory": "8Gi"}
HEAD_PORTS = [("gcs-server", 6379), ("dashboard", 8265), ("client", 10001)]
STAGE_TAGS = {"teacher_generations": "gen", "evaluation": "eval", "teacher_scoring": "score", "answers": "ans"}


def rayjob_name(campaign: str, stage: str, run_id: str, salt: str) -> str:
    """``ray-<campaign>-<stage>-<run>-<salt>``, at most 41 characters: KubeRay names the job's cluster, head
    Service and pods after it, and a RayJob name longer than 47 leaves them no room within 63."""
    slug = re.sub(r"[^a-z0-9]+", "-", campaign.lower()).strip("-")[:16].strip("-") or "campaign"
    tag = STAGE_TAGS.get(stage, re.sub(r"[^a-z0-9]", "", stage.lower())[:5])
    run = re.sub(r"[^a-z0-9]", "", run_id.lower())[:8] or "manual"
    tail = re.sub(r"[^a-z0-9]", "", salt.lower())[:5]
    return "-".join(p for p in ("ray", slug, tag, run, tail) if p)


@dataclass(frozen=True)
class RayWorkload:
    """Everything that decides the RayJob of one generation stage."""

    spec: CampaignSpec
    stage: str  # teacher_generations | evaluation | ...
    job_file: str  # JOB.json at a path the pods see (on the shared artifacts volume)
    name: str
    run_id: str = "manual"
    asset_key: str = ""
    pipes_env: dict[str, str] = field(default_factory=dict)  # Dagster Pipes bootstrap (no secrets): driver only
    owner: dict[str, str] | None = None  # the Dagster run pod ({name, uid}) in the same namespace

    @property
    def cluster(self) -> KubernetesSpec:
        if self.spec.kubernetes is None:
            raise ValueError(f"campaign {self.spec.name}: execution.kuberay needs the campaign's `kubernetes:` section")
        return self.spec.kubernetes

    @property
    def namespace(self) -> str:
        return self.cluster.namespace

    @property
    def image(self) -> str:
        k = self.spec.execution.kuberay
        return (k.image if k is not None and k.image else None) or self.cluster.image


# --------------------------------------------------------------------------- metadata


def selector_labels(w: RayWorkload) -> dict[str, str]:
    """The labels of this launch's head and worker pods (KubeRay copies the template's labels to them)."""
    return {mf.INSTANCE_LABEL: w.name, mf.COMPONENT_LABEL: COMPONENT}


def object_labels(w: RayWorkload) -> dict[str, str]:
    """Labels on the RayJob and its pod templates: the campaign, the Dagster run (the reaper's key) and the asset."""
    labels = {
        **w.cluster.labels,
        "app.kubernetes.io/name": "campaign-ray",
        "app.kubernetes.io/part-of": mf.PART_OF,
        "app.kubernetes.io/managed-by": "dagster",
        "dagster/campaign": mf.label_value(w.spec.name),
        mf.RUN_ID_LABEL: mf.label_value(w.run_id),
        "campaign-orchestrator/stage": mf.label_value(w.stage),
        **selector_labels(w),
    }
    if w.asset_key:
        labels["dagster/asset-key"] = mf.label_value(w.asset_key.replace("/", "."))
    return labels


def object_annotations(w: RayWorkload) -> dict[str, str]:
    ex = w.spec.execution
    ann = {
        "dagster/run-id": w.run_id,
        "campaign-orchestrator/ray-job-file": w.job_file,
        "campaign-orchestrator/replicas": str(ex.replicas),
        "campaign-orchestrator/shard-prompts": str(ex.shard_prompts),
    }
    if w.asset_key:
        ann["dagster/asset-key"] = w.asset_key
    return ann


def _metadata(w: RayWorkload) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": w.name,
        "namespace": w.namespace,
        "labels": object_labels(w),
        "annotations": object_annotations(w),
    }
    if w.owner:
        meta["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": w.owner["name"],
                "uid": w.owner["uid"],
                "blockOwnerDeletion": False,
                "controller": False,
            }
        ]
    return meta


# --------------------------------------------------------------------------- pods


def container_env(w: RayWorkload) -> list[dict[str, Any]]:
    """Plain variables (``kubernetes.env``), then Secret references (``kubernetes.secret_env``, values never
    inlined): every Ray process of the pod (the driver on the head, the replicas on the workers) inherits them."""
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "TOKENIZERS_PARALLELISM", "value": "false"}]
    env += [{"name": k, "value": v} for k, v in sorted(w.cluster.env.items())]
    return env + mf.secret_env(w.cluster)


def _resources(amounts: dict[str, str]) -> dict[str, dict[str, str]]:
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def head_resources(w: RayWorkload) -> dict[str, dict[str, str]]:
    head = w.spec.execution.kuberay.head
    return _resources(
        {
            "cpu": (head.cpu if head and head.cpu else HEAD_DEFAULTS["cpu"]),
            "memory": (head.memory if head and head.memory else HEAD_DEFAULTS["memory"]),
        }
    )


def worker_resources(w: RayWorkload) -> dict[str, dict[str, str]]:
    """One replica's pod: ``num_gpus_per_replica`` GPUs rounded up (``kubernetes.gpu_resource``), CPUs for its
    ``num_cpus_per_replica`` rounded up (KubeRay gives Ray the CPU limit), memory from ``worker.memory`` or
    ``kubernetes.memory``. Requests equal limits (extended resources must)."""
    ex, c = w.spec.execution, w.cluster
    worker = ex.kuberay.worker
    amounts: dict[str, str] = {}
    gpus = ex.gpus_per_worker_pod
    if gpus:
        if not c.gpu_resource:
            raise ValueError(
                f"campaign {w.spec.name}: execution.num_gpus_per_replica is {ex.num_gpus_per_replica:g} "
                f"but kubernetes.gpu_resource is null; set it (e.g. nvidia.com/gpu) or use CPU replicas "
                f"(num_gpus_per_replica: 0)"
            )
        amounts[c.gpu_resource] = str(gpus)
    amounts["cpu"] = worker.cpu if worker and worker.cpu else str(math.ceil(ex.num_cpus_per_replica))
    memory = worker.memory if worker and worker.memory else c.memory
    if memory:
        amounts["memory"] = memory
    return _resources(amounts)


def _container(w: RayWorkload, name: str, resources: dict, ports: list[tuple[str, int]]) -> dict[str, Any]:
    _, mounts = mf.cluster_volumes(w.cluster)
    c: dict[str, Any] = {
        "name": name,
        "image": w.image,
        "imagePullPolicy": w.cluster.image_pull_policy,
        "workingDir": w.cluster.working_dir,
        "env": container_env(w),
        "volumeMounts": mounts,
    }
    if ports:
        c["ports"] = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports]
    if resources:
        c["resources"] = resources
    return c


def pod_template(w: RayWorkload, container: dict[str, Any]) -> dict[str, Any]:
    volumes, _ = mf.cluster_volumes(w.cluster)
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": w.cluster.termination_grace_period_seconds,
        "enableServiceLinks": False,
        **mf.pod_placement(w.cluster),
    }
    meta: dict[str, Any] = {"labels": object_labels(w)}
    if w.cluster.annotations or w.asset_key:
        meta["annotations"] = {**w.cluster.annotations, **({"dagster/asset-key": w.asset_key} if w.asset_key else {})}
    return {"metadata": meta, "spec": spec}


def ray_cluster_spec(w: RayWorkload) -> dict[str, Any]:
    """One head (the driver; 0 CPUs for replicas unless ``head_runs_replicas``) and one worker group of
    ``execution.replicas`` pods, fixed size (min = max = replicas, no autoscaler)."""
    ex = w.spec.execution
    head_params = {"dashboard-host": "0.0.0.0"}
    if not ex.kuberay.head_runs_replicas:
        head_params["num-cpus"] = "0"
    return {
        "rayVersion": ex.kuberay.ray_version,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            "rayStartParams": head_params,
            "template": pod_template(w, _container(w, HEAD_CONTAINER, head_resources(w), HEAD_PORTS)),
        },
        "workerGroupSpecs": [
            {
                "groupName": WORKER_GROUP,
                "replicas": ex.replicas,
                "minReplicas": ex.replicas,
                "maxReplicas": ex.replicas,
                "rayStartParams": {},
                "template": pod_template(w, _container(w, WORKER_CONTAINER, worker_resources(w), [])),
            }
        ],
    }


def summary_path(job_file: str) -> str:
    """Where the job writes its JSON summary (``--summary``): beside JOB.json, on the shared volume."""
    return job_file.rsplit("/", 1)[0] + "/" + SUMMARY_FILE if "/" in job_file else SUMMARY_FILE


def runtime_env_yaml(w: RayWorkload) -> str:
    """The job's runtime environment: the driver's Pipes bootstrap variables (context and where to write
    messages: stderr, which ``ray job submit`` prints in the submitter pod's log)."""
    env_vars = {"PYTHONUNBUFFERED": "1", **dict(sorted(w.pipes_env.items()))}
    return yaml.safe_dump({"env_vars": env_vars}, sort_keys=False)


def ray_job(w: RayWorkload) -> dict[str, Any]:
    """The ``ray.io/v1`` RayJob of one generation stage (``K8sJobMode``: a submitter pod runs the job and prints
    its log)."""
    k = w.spec.execution.kuberay
    if k is None:
        raise ValueError(f"campaign {w.spec.name} has no execution.kuberay section; nothing to render")
    spec: dict[str, Any] = {
        "entrypoint": ENTRYPOINT.format(job_file=w.job_file, summary_file=summary_path(w.job_file)),
        "runtimeEnvYAML": runtime_env_yaml(w),
        "submissionMode": "K8sJobMode",
    }
    if k.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = k.active_deadline_seconds
    if k.ray_cluster:  # a long-lived cluster: never shut down by this job
        spec["clusterSelector"] = {RAY_CLUSTER_LABEL: k.ray_cluster}
    else:
        spec |= {
            "shutdownAfterJobFinishes": k.shutdown_after_job_finishes,
            "ttlSecondsAfterFinished": k.ttl_seconds_after_finished,
            "rayClusterSpec": ray_cluster_spec(w),
        }
    return {"apiVersion": f"{RAYJOB_GROUP}/{RAYJOB_VERSION}", "kind": "RayJob", "metadata": _metadata(w), "spec": spec}


def campaign_ray_jobs(
    spec: CampaignSpec,
    run_id: str = "manual",
    salt: str = "00000",
    stages: tuple[str, ...] = ("teacher_generations", "evaluation"),
) -> list[dict[str, Any]]:
    """The RayJobs ``campaign k8s-render`` shows: one per generation stage, with a placeholder JOB.json path on the
    artifacts volume (the stage writes the real one under its content-addressed directory)."""
    if spec.execution.kuberay is None:
        return []
    if spec.kubernetes is None:
        raise ValueError(f"campaign {spec.name}: execution.kuberay needs the campaign's `kubernetes:` section")
    root = spec.kubernetes.artifacts.mount_path.rstrip("/")
    return [
        ray_job(
            RayWorkload(
                spec=spec,
                stage=stage,
                job_file=f"{root}/{spec.name}/{stage}/<stage-key>/ray_job.json",
                name=rayjob_name(spec.name, stage, run_id, salt),
                run_id=run_id,
                asset_key=f"{spec.name}/{stage}",
            )
        )
        for stage in stages
    ]


# --------------------------------------------------------------------------- status


FAILED_DEPLOYMENT = {"Failed", "ValidationFailed"}


def rayjob_state(obj: dict[str, Any]) -> tuple[str, str]:
    """(``running`` | ``succeeded`` | ``failed``, why) of a RayJob from its status: the Ray job's status
    (``jobStatus``: PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED) and the operator's ``jobDeploymentStatus``
    (Initializing, Running, Complete, Failed, ValidationFailed, ...), which alone says why a job never started
    (``activeDeadlineSeconds`` passed, a spec the operator refused)."""
    st = obj.get("status") or {}
    job, deploy, msg = st.get("jobStatus") or "", st.get("jobDeploymentStatus") or "", st.get("message") or ""
    why = "; ".join(
        x for x in (f"jobStatus {job}" if job else "", f"jobDeploymentStatus {deploy}" if deploy else "", msg) if x
    )
    if job == "SUCCEEDED":
        return "succeeded", why
    if job in ("FAILED", "STOPPED") or deploy in FAILED_DEPLOYMENT:
        return "failed", why
    return "running", why
