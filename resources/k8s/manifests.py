"""Kubernetes manifests for one training run: pure functions from the campaign spec to dicts.

Nothing here talks to a cluster or imports the Kubernetes client, so every field is unit-tested
and every manifest is validated offline against the Kubernetes schema (see ``validate.py``).

Two workloads run the same ``python -m training --config FILE`` the local launcher runs:

* ``indexed_job`` (default, no operator needed): a ``batch/v1`` Job with
  ``completionMode: Indexed`` (one pod per node) and a headless Service that gives pod 0 the
  stable name ``<name>-0.<name>``. Every pod runs ``torchrun --nnodes N --nproc-per-node G
  --rdzv-backend c10d --rdzv-endpoint <name>-0.<name>:PORT``. The node rank comes from the
  completion index (``NODE_RANK``); note that torchrun's c10d rendezvous assigns global ranks by
  its own ordering, so global rank 0 is usually, not necessarily, on pod 0, which is why the
  launcher reads Pipes messages from every pod's log.
* ``pytorchjob``: a Kubeflow ``PyTorchJob`` (Master + Workers) for clusters that run the
  training operator; the operator sets ``MASTER_ADDR``/``MASTER_PORT``/``RANK`` and rank 0 is on
  the Master.

Every container gets ``training.distributed_env`` (the NCCL / torch.distributed variables the
local launcher exports to torchrun) next to ``kubernetes.env``; a variable set in both is an error
(``env_conflicts``), never a silent precedence.

Secrets are referenced by name only (``secretKeyRef``, secret volumes, ``imagePullSecrets``);
no value from the Dagster process's environment is copied into a manifest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from campaigns.spec import KubernetesSpec, TrainingSpec
from training.diagnostics import distributed_env

CONTAINER = "trainer"
PYTORCHJOB_CONTAINER = "pytorch"  # the training operator requires this container name
PART_OF = "campaign-orchestrator"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
RUN_ID_LABEL = "dagster/run-id"
PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, PYTORCHJOB_PLURAL = "kubeflow.org", "v1", "pytorchjobs"

_NOT_LABEL_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


def label_value(value: str) -> str:
    """A string made into a valid label value (at most 63 characters, alphanumeric at both ends)."""
    v = _NOT_LABEL_CHARS.sub("-", value)[:63]
    return v.strip("-_.")


def workload_name(campaign: str, run_id: str, salt: str) -> str:
    """``train-<campaign>-<run>-<salt>``: a DNS-1035 label short enough for ``<name>-<index>`` hostnames."""
    slug = re.sub(r"[^a-z0-9]+", "-", campaign.lower()).strip("-")[:24].strip("-") or "campaign"
    run = re.sub(r"[^a-z0-9]", "", run_id.lower())[:8] or "manual"
    tail = re.sub(r"[^a-z0-9]", "", salt.lower())[:5]
    return "-".join(p for p in ("train", slug, run, tail) if p)


@dataclass(frozen=True)
class Workload:
    """Everything that decides the manifests of one launch."""

    campaign: str
    training: TrainingSpec
    cluster: KubernetesSpec
    job_file: str  # the TrainJob JSON, at a path the pods see (on the shared artifacts volume)
    name: str
    run_id: str = "manual"
    asset_key: str = ""  # e.g. "demo/student_adapter"
    pipes_env: dict[str, str] = field(default_factory=dict)  # Dagster Pipes bootstrap (no secrets)
    owner: dict[str, str] | None = None  # the Dagster run pod ({name, uid}) when it runs in the same namespace

    @property
    def nodes(self) -> int:
        return self.training.nodes

    @property
    def gpus(self) -> int:
        return self.training.processes_per_node

    @property
    def namespace(self) -> str:
        return self.cluster.namespace

    @property
    def rendezvous_endpoint(self) -> str:
        return f"{self.name}-0.{self.name}:{self.cluster.rendezvous_port}"


# --------------------------------------------------------------------------- metadata


def selector_labels(w: Workload) -> dict[str, str]:
    """The labels that find this launch's pods (Service selector, pod listing)."""
    return {INSTANCE_LABEL: w.name, COMPONENT_LABEL: "trainer"}


def object_labels(w: Workload) -> dict[str, str]:
    """Labels on every object: they tie it to the campaign, the Dagster run and the asset."""
    labels = {
        **w.cluster.labels,
        "app.kubernetes.io/name": "campaign-trainer",
        "app.kubernetes.io/part-of": PART_OF,
        "app.kubernetes.io/managed-by": "dagster",
        "dagster/campaign": label_value(w.campaign),
        RUN_ID_LABEL: label_value(w.run_id),
        **selector_labels(w),
    }
    if w.asset_key:
        labels["dagster/asset-key"] = label_value(w.asset_key.replace("/", "."))
    return labels


def object_annotations(w: Workload) -> dict[str, str]:
    ann = {
        "dagster/run-id": w.run_id,
        "campaign-orchestrator/train-job-file": w.job_file,
        "campaign-orchestrator/world-size": str(w.training.world_size),
        "campaign-orchestrator/sharding": w.training.sharding,
    }
    if w.asset_key:
        ann["dagster/asset-key"] = w.asset_key
    return ann


def owner_references(w: Workload) -> list[dict[str, Any]]:
    """The run pod owns the objects: if it dies hard (node loss, SIGKILL), Kubernetes garbage-collects them."""
    if not w.owner:
        return []
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": w.owner["name"],
            "uid": w.owner["uid"],
            "blockOwnerDeletion": False,
            "controller": False,
        }
    ]


def _metadata(w: Workload, extra_annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": w.name,
        "namespace": w.namespace,
        "labels": object_labels(w),
        "annotations": {**object_annotations(w), **(extra_annotations or {})},
    }
    if w.owner:
        meta["ownerReferences"] = owner_references(w)
    return meta


# --------------------------------------------------------------------------- container


def torchrun_args(w: Workload, *, pytorchjob: bool = False) -> list[str]:
    """The container command: torchrun around ``python -m training --config FILE``."""
    tail = ["-m", "training", "--config", w.job_file]
    if w.nodes == 1:
        return ["torchrun", "--standalone", "--nproc-per-node", str(w.gpus), *tail]
    head = ["torchrun", "--nnodes", str(w.nodes), "--nproc-per-node", str(w.gpus)]
    if pytorchjob:  # static rendezvous on the Master the operator names in MASTER_ADDR / MASTER_PORT
        rdzv = ["--node-rank", "$(RANK)", "--master-addr", "$(MASTER_ADDR)", "--master-port", "$(MASTER_PORT)"]
    else:
        rdzv = [
            "--node-rank",
            "$(NODE_RANK)",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            w.rendezvous_endpoint,
            "--rdzv-id",
            w.name,
            "--max-restarts",
            "0",
        ]
    return [*head, *rdzv, *tail]


def env_conflicts(training: TrainingSpec, cluster: KubernetesSpec) -> str | None:
    """Why the pods' environment is ambiguous (a variable in ``training.distributed_env`` and in
    ``kubernetes.env`` / ``kubernetes.secret_env``), or None. A pod gets each variable once, so which
    value wins would be silent; it is an error instead."""
    dist = distributed_env(training)
    where = {n: "kubernetes.env" for n in cluster.env}
    where.update({s.name: "kubernetes.secret_env" for s in cluster.secret_env})
    clash = sorted(n for n in dist if n in where)
    if not clash:
        return None
    both = ", ".join(f"{n} (training.distributed_env and {where[n]})" for n in clash)
    return (
        f"environment variables set twice: {both}. Set each in one place: keep it under training.distributed_env"
        f" (validated, exported to every rank by both the local and the k8s launcher) and remove it from"
        f" {' / '.join(sorted({where[n] for n in clash}))}"
    )


def container_env(w: Workload, *, pytorchjob: bool = False) -> list[dict[str, Any]]:
    """Plain variables first (``kubernetes.env``, then ``training.distributed_env``), then Pipes bootstrap,
    then Secret references (values never inlined). Raises ``ValueError`` on ``env_conflicts``."""
    problem = env_conflicts(w.training, w.cluster)
    if problem:
        raise ValueError(f"campaign {w.campaign}: {problem}")
    env: list[dict[str, Any]] = []
    if not pytorchjob:
        env.append(
            {
                "name": "NODE_RANK",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}},
            }
        )
    env += [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "TOKENIZERS_PARALLELISM", "value": "false"}]
    env += [{"name": k, "value": v} for k, v in sorted(w.cluster.env.items())]
    env += [{"name": k, "value": v} for k, v in sorted(distributed_env(w.training).items())]
    env += [{"name": k, "value": v} for k, v in sorted(w.pipes_env.items())]
    return env + secret_env(w.cluster)


def secret_env(cluster: KubernetesSpec) -> list[dict[str, Any]]:
    """``kubernetes.secret_env`` as ``secretKeyRef`` variables: the Secret and key by name, never a value."""
    env: list[dict[str, Any]] = []
    for s in cluster.secret_env:
        ref = {"name": s.secret, "key": s.key}
        if s.optional:
            ref["optional"] = True
        env.append({"name": s.name, "valueFrom": {"secretKeyRef": ref}})
    return env


def container_resources(w: Workload) -> dict[str, dict[str, str]]:
    """Requests equal limits: GPUs (extended resources must), and CPU / memory for a Guaranteed pod."""
    amounts: dict[str, str] = {}
    if w.cluster.gpu_resource:
        amounts[w.cluster.gpu_resource] = str(w.gpus)
    if w.cluster.cpu:
        amounts["cpu"] = w.cluster.cpu
    if w.cluster.memory:
        amounts["memory"] = w.cluster.memory
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def volumes_and_mounts(w: Workload) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return cluster_volumes(w.cluster)


def cluster_volumes(c: KubernetesSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of every pod of the campaign: /dev/shm, the artifacts claim, ``volumes``,
    ``secret_volumes``."""
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": c.shm_size}}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    for vname, claim in [("artifacts", c.artifacts)] + [(f"volume-{i}", v) for i, v in enumerate(c.volumes)]:
        pvc: dict[str, Any] = {"claimName": claim.claim}
        mount: dict[str, Any] = {"name": vname, "mountPath": claim.mount_path}
        if claim.read_only:
            pvc["readOnly"] = True
            mount["readOnly"] = True
        if claim.sub_path:
            mount["subPath"] = claim.sub_path
        volumes.append({"name": vname, "persistentVolumeClaim": pvc})
        mounts.append(mount)
    for i, s in enumerate(c.secret_volumes):
        volumes.append({"name": f"secret-{i}", "secret": {"secretName": s.secret, "defaultMode": 0o440}})
        mounts.append({"name": f"secret-{i}", "mountPath": s.mount_path, "readOnly": True})
    return volumes, mounts


def container(w: Workload, *, pytorchjob: bool = False) -> dict[str, Any]:
    _, mounts = volumes_and_mounts(w)
    c: dict[str, Any] = {
        "name": PYTORCHJOB_CONTAINER if pytorchjob else CONTAINER,
        "image": w.cluster.image,
        "imagePullPolicy": w.cluster.image_pull_policy,
        "command": torchrun_args(w, pytorchjob=pytorchjob),
        "workingDir": w.cluster.working_dir,
        "env": container_env(w, pytorchjob=pytorchjob),
        "ports": [
            {
                "name": "pytorchjob-port" if pytorchjob else "rendezvous",
                "containerPort": w.cluster.rendezvous_port,
                "protocol": "TCP",
            }
        ],
        "volumeMounts": mounts,
    }
    res = container_resources(w)
    if res:
        c["resources"] = res
    return c


def pod_spec(w: Workload, *, pytorchjob: bool = False) -> dict[str, Any]:
    c = w.cluster
    volumes, _ = volumes_and_mounts(w)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # torchrun owns restarts; a failed pod fails the job (fail fast)
        "containers": [container(w, pytorchjob=pytorchjob)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": c.termination_grace_period_seconds,
        "enableServiceLinks": False,
    }
    if w.nodes > 1 and not pytorchjob:
        spec["subdomain"] = w.name  # with the headless Service: <name>-<index>.<name> resolves to pod <index>
    return spec | pod_placement(c)


def pod_placement(c: KubernetesSpec) -> dict[str, Any]:
    """Pod spec fields from the campaign's ``kubernetes:`` section: node selector, tolerations, affinity, priority
    class, service account and image pull secrets (each only when set)."""
    spec: dict[str, Any] = {}
    if c.node_selector:
        spec["nodeSelector"] = dict(c.node_selector)
    if c.tolerations:
        spec["tolerations"] = [_toleration(t) for t in c.tolerations]
    if c.affinity:
        spec["affinity"] = c.affinity
    if c.priority_class:
        spec["priorityClassName"] = c.priority_class
    if c.service_account:
        spec["serviceAccountName"] = c.service_account
    if c.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in c.image_pull_secrets]
    return spec


def _toleration(t) -> dict[str, Any]:
    out: dict[str, Any] = {"operator": t.operator}
    for src, dst in (
        ("key", "key"),
        ("value", "value"),
        ("effect", "effect"),
        ("toleration_seconds", "tolerationSeconds"),
    ):
        v = getattr(t, src)
        if v is not None:
            out[dst] = v
    return out


def pod_template(w: Workload, *, pytorchjob: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": object_labels(w)}
    if w.cluster.annotations or w.asset_key:
        meta["annotations"] = {**w.cluster.annotations, **({"dagster/asset-key": w.asset_key} if w.asset_key else {})}
    return {"metadata": meta, "spec": pod_spec(w, pytorchjob=pytorchjob)}


# --------------------------------------------------------------------------- workloads


def indexed_job(w: Workload) -> dict[str, Any]:
    """``batch/v1`` Job: one pod per node, ``completionMode: Indexed``, fail fast on any non-zero exit."""
    c = w.cluster
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": w.nodes,
        "parallelism": w.nodes,
        "backoffLimit": c.backoff_limit,
        # A trainer that exits non-zero (a bug, OOMKilled = 137) fails the whole job at once instead of
        # waiting for the other ranks to hit the NCCL timeout; only disruptions count against backoffLimit.
        "podFailurePolicy": {
            "rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]}}
            ]
        },
        "template": pod_template(w),
    }
    if c.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = c.active_deadline_seconds
    if c.ttl_seconds_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = c.ttl_seconds_after_finished
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(w), "spec": spec}


def headless_service(w: Workload) -> dict[str, Any]:
    """Gives pod 0 a DNS name before it is Ready, so the c10d rendezvous can start."""
    meta: dict[str, Any] = {"name": w.name, "namespace": w.namespace, "labels": object_labels(w)}
    if w.owner:
        meta["ownerReferences"] = owner_references(w)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(w),
            "ports": [
                {
                    "name": "rendezvous",
                    "port": w.cluster.rendezvous_port,
                    "targetPort": w.cluster.rendezvous_port,
                    "protocol": "TCP",
                }
            ],
        },
    }


def pytorch_job(w: Workload) -> dict[str, Any]:
    """Kubeflow training-operator ``PyTorchJob``: Master (rank 0) + ``nodes - 1`` Workers."""
    c = w.cluster
    run_policy: dict[str, Any] = {"cleanPodPolicy": "All", "backoffLimit": c.backoff_limit}
    if c.active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = c.active_deadline_seconds
    if c.ttl_seconds_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = c.ttl_seconds_after_finished
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": pod_template(w, pytorchjob=True)}}
    if w.nodes > 1:
        replicas["Worker"] = {
            "replicas": w.nodes - 1,
            "restartPolicy": "Never",
            "template": pod_template(w, pytorchjob=True),
        }
    return {
        "apiVersion": f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}",
        "kind": "PyTorchJob",
        "metadata": _metadata(w),
        "spec": {"runPolicy": run_policy, "pytorchReplicaSpecs": replicas},
    }


def build_manifests(w: Workload) -> list[dict[str, Any]]:
    """The objects to create, in order (the Service first, so pod 0's name resolves when pods start)."""
    if w.cluster.workload == "pytorchjob":
        return [pytorch_job(w)]
    if w.nodes == 1:
        return [indexed_job(w)]
    return [headless_service(w), indexed_job(w)]


def mount_roots(cluster: KubernetesSpec) -> list[str]:
    return [cluster.artifacts.mount_path] + [v.mount_path for v in cluster.volumes]


def unreachable_paths(paths: dict[str, str], cluster: KubernetesSpec) -> list[str]:
    """``field=path`` for each path the training pods cannot see (outside every mounted volume)."""
    roots = mount_roots(cluster)

    def under(p: str, root: str) -> bool:
        return root == "/" or p == root or p.startswith(root.rstrip("/") + "/")

    return [f"{k}={p}" for k, p in paths.items() if not any(under(p, r) for r in roots)]
