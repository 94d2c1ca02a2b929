"""The ``kubernetes:`` section: the cluster workload (image, namespace, GPUs, volumes, secrets)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from campaigns.spec.common import _Strict

K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # DNS-1123 label (namespaces, claims, accounts)
K8S_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # DNS-1123 subdomain (secrets, priority classes)
K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
K8S_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
K8S_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Names that hold credentials: their values belong in a Kubernetes Secret (`secret_env`), never in the spec.
SECRET_LIKE_ENV = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL", re.I)


def _k8s_name(v: str | None, what: str, pattern: re.Pattern = K8S_NAME, max_len: int = 63) -> str | None:
    if v is not None and (len(v) > max_len or not pattern.match(v)):
        raise ValueError(
            f"{what} must be a Kubernetes name (lowercase letters, digits, '-'; at most {max_len}), got {v!r}"
        )
    return v


def _quantity(v: str | None, what: str) -> str | None:
    if v is not None and not K8S_QUANTITY.match(v):
        raise ValueError(f"{what} must be a Kubernetes quantity such as '64Gi', '500m' or '32', got {v!r}")
    return v


def _labels(v: dict[str, str]) -> dict[str, str]:
    for k, val in v.items():
        if len(k.split("/")[-1]) > 63 or not K8S_LABEL_KEY.match(k):
            raise ValueError(f"label key {k!r} is not a valid Kubernetes label key")
        if len(val) > 63 or not K8S_LABEL_VALUE.match(val):
            raise ValueError(f"label {k}={val!r}: values are at most 63 letters, digits, '-', '_', '.'")
    return v


class TolerationSpec(_Strict):
    """One Kubernetes toleration (e.g. of the ``nvidia.com/gpu`` taint on GPU nodes)."""

    key: str | None = Field(None, description="Taint key; empty with operator Exists tolerates every taint.")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal: match `value`; Exists: any value.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty tolerates all effects."
    )
    toleration_seconds: int | None = Field(None, ge=0, description="NoExecute only: how long the pod stays bound.")


class SecretEnvSpec(_Strict):
    """An environment variable read from a Kubernetes Secret (the value never appears in manifests)."""

    name: str = Field(description="Environment variable name in the trainer container, e.g. HF_TOKEN.")
    secret: str = Field(description="Name of the Kubernetes Secret in the job's namespace.")
    key: str = Field(description="Key inside the Secret.")
    optional: bool = Field(False, description="Start even when the Secret or key is missing.")

    @field_validator("name")
    @classmethod
    def _env(cls, v: str) -> str:
        if not ENV_NAME.match(v):
            raise ValueError(f"not an environment variable name: {v!r}")
        return v

    @field_validator("secret")
    @classmethod
    def _secret(cls, v: str) -> str:
        return _k8s_name(v, "secret", K8S_SUBDOMAIN, 253)


class SecretVolumeSpec(_Strict):
    """A Kubernetes Secret mounted read-only as files (e.g. a netrc or a cloud credentials file)."""

    secret: str = Field(description="Name of the Kubernetes Secret in the job's namespace.")
    mount_path: str = Field(description="Absolute directory in the container where the Secret's keys appear as files.")

    @field_validator("secret")
    @classmethod
    def _secret(cls, v: str) -> str:
        return _k8s_name(v, "secret", K8S_SUBDOMAIN, 253)

    @field_validator("mount_path")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"mount_path must be absolute, got {v!r}")
        return v


class VolumeClaimSpec(_Strict):
    """A PersistentVolumeClaim mounted into every training pod."""

    claim: str = Field(description="Name of the PersistentVolumeClaim (ReadWriteMany when several nodes write).")
    mount_path: str = Field(description="Absolute directory where the claim is mounted.")
    read_only: bool = Field(False, description="Mount read-only (e.g. a shared model cache).")
    sub_path: str | None = Field(None, description="Mount only this sub-directory of the volume.")

    @field_validator("claim")
    @classmethod
    def _claim(cls, v: str) -> str:
        return _k8s_name(v, "claim", K8S_SUBDOMAIN, 253)

    @field_validator("mount_path")
    @classmethod
    def _abs(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"mount_path must be absolute, got {v!r}")
        return v.rstrip("/") or "/"


class KubernetesSpec(_Strict):
    """Where and how `training.launcher: k8s` runs the trainer: one pod per node, one process per GPU.

    Kubernetes objects passed through verbatim (``affinity``) use Kubernetes' own field names and
    are checked against the Kubernetes schema when the manifests are rendered. Credentials are
    only ever *named* here (``secret_env``, ``secret_volumes``, ``image_pull_secrets``).
    """

    workload: Literal["indexed_job", "pytorchjob"] = Field(
        "indexed_job",
        description="indexed_job: a batch/v1 Indexed Job + headless Service (no operator needed);"
        " pytorchjob: a Kubeflow PyTorchJob (needs the training operator).",
    )
    namespace: str = Field("default", description="Namespace the training objects are created in.")
    image: str = Field(description="Trainer image (deploy/Dockerfile), ideally pinned by tag or digest.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Kubernetes imagePullPolicy of the training pods."
    )
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secrets for a private registry.")
    service_account: str | None = Field(None, description="ServiceAccount of the training pods.")
    priority_class: str | None = Field(None, description="PriorityClass of the training pods (preemption order).")
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the pods require, e.g. nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3.",
    )
    tolerations: list[TolerationSpec] = Field(default_factory=list, description="Taints the pods tolerate.")
    affinity: dict[str, Any] | None = Field(
        None, description="A Kubernetes Affinity object (nodeAffinity / podAffinity / podAntiAffinity), verbatim."
    )
    gpu_resource: str | None = Field(
        "nvidia.com/gpu",
        description="Extended resource requested per process (`processes_per_node` of them per"
        " pod); null runs CPU-only pods (gloo), e.g. on a test cluster.",
    )
    cpu: str | None = Field(None, description="CPU request and limit per pod, e.g. '96'.")
    memory: str | None = Field(None, description="Memory request and limit per pod, e.g. '1600Gi'.")
    shm_size: str = Field(
        "64Gi", description="Size limit of the in-memory /dev/shm volume (NCCL, data loader workers)."
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Plain environment variables, e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG."
        " Credentials go in `secret_env`.",
    )
    secret_env: list[SecretEnvSpec] = Field(default_factory=list, description="Environment variables from Secrets.")
    secret_volumes: list[SecretVolumeSpec] = Field(default_factory=list, description="Secrets mounted as files.")
    artifacts: VolumeClaimSpec = Field(
        default_factory=lambda: VolumeClaimSpec(claim="campaign-artifacts", mount_path="/app/artifacts"),
        description="The shared volume holding the artifact root, mounted at the same path in the Dagster run"
        " pod and the training pods (the trainer reads and writes the paths Dagster gives it).",
    )
    volumes: list[VolumeClaimSpec] = Field(
        default_factory=list, description="More claims, e.g. a read-only model cache."
    )
    working_dir: str = Field("/app", description="Working directory of the trainer container (the image's code root).")
    rendezvous_port: int = Field(29500, ge=1024, le=65535, description="c10d rendezvous / master port on node 0.")
    backoff_limit: int = Field(0, ge=0, le=100, description="Job retries before it is marked failed.")
    active_deadline_seconds: int | None = Field(
        None, ge=1, description="Kubernetes stops the job after this many seconds of running."
    )
    ttl_seconds_after_finished: int | None = Field(
        3600,
        ge=0,
        description="Kubernetes deletes a finished job after this long (a backstop: the launcher cleans up).",
    )
    termination_grace_period_seconds: int = Field(30, ge=0, description="Time a pod gets to exit after SIGTERM.")
    labels: dict[str, str] = Field(
        default_factory=dict, description="Extra labels on every object (team, cost centre)."
    )
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations on the pods.")

    @field_validator("namespace", "service_account")
    @classmethod
    def _names(cls, v: str | None, info) -> str | None:
        return _k8s_name(v, info.field_name)

    @field_validator("priority_class")
    @classmethod
    def _subdomain(cls, v: str | None) -> str | None:
        return _k8s_name(v, "priority_class", K8S_SUBDOMAIN, 253)

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, v: list[str]) -> list[str]:
        for s in v:
            _k8s_name(s, "image_pull_secrets entry", K8S_SUBDOMAIN, 253)
        return v

    @field_validator("cpu", "memory", "shm_size")
    @classmethod
    def _quantities(cls, v: str | None, info) -> str | None:
        return _quantity(v, info.field_name)

    @field_validator("labels")
    @classmethod
    def _label_map(cls, v: dict[str, str]) -> dict[str, str]:
        return _labels(v)

    @field_validator("affinity")
    @classmethod
    def _affinity(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        allowed = {"nodeAffinity", "podAffinity", "podAntiAffinity"}
        if v is not None and not set(v) <= allowed:
            raise ValueError(f"affinity takes only {sorted(allowed)} (Kubernetes field names), got {sorted(v)}")
        return v

    @field_validator("env")
    @classmethod
    def _plain_env(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not ENV_NAME.match(name):
                raise ValueError(f"not an environment variable name: {name!r}")
            if SECRET_LIKE_ENV.search(name):
                raise ValueError(
                    f"env {name} looks like a credential: store it in a Kubernetes Secret and list it under"
                    f" `secret_env` (name: {name}, secret: <secret name>, key: <key>) instead of writing its value here"
                )
        return v

    @model_validator(mode="after")
    def _unique_mounts(self) -> KubernetesSpec:
        paths = (
            ["/dev/shm", self.artifacts.mount_path]
            + [v.mount_path for v in self.volumes]
            + [s.mount_path for s in self.secret_volumes]
        )
        dup = sorted({p for p in paths if paths.count(p) > 1})
        if dup:
            raise ValueError(f"two volumes are mounted at the same path: {dup}")
        names = [e.name for e in self.secret_env]
        clash = sorted(set(names) & set(self.env) | {n for n in names if names.count(n) > 1})
        if clash:
            raise ValueError(f"environment variables defined twice (env / secret_env): {clash}")
        return self
