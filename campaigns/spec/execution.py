"""The ``execution:`` section: where the generation stages run (one process, or a Ray cluster).

The generation stages are the teacher's generations, the teacher scoring held-out items, and the
candidate's and base's answers in evaluation. ``executor: local`` (the default) runs each in the stage's
own process, as before. ``executor: ray`` splits a stage's prompts into shards by content hash and runs
them on an actor pool (one model replica per actor) of a Ray cluster: a local cluster the stage starts
when ``ray_address`` is empty, an existing one otherwise. On Kubernetes (``execution.kuberay``) the stage is
meant to run as a KubeRay ``RayJob`` (manifests and launcher exist; the stages refuse it until they call the
launcher, docs/scaleout.md): a Ray cluster of one head and ``replicas`` worker pods created for the job (or
a long-lived ``RayCluster`` it is submitted to), which runs ``python -m campaign_orchestrator.generation.scaleout --job
JOB.json``; namespace, image, node selectors, tolerations, volumes and secrets come from the campaign's
``kubernetes:`` section, as for training (docs/scaleout.md).

``executor`` was called ``engine`` before issue 44 (an *engine* is the local loop that decodes, docs/concepts.md);
the old spelling is still read, with a warning that names the new one.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from campaigns.spec.common import _Strict
from campaigns.spec.kubernetes import K8S_NAME, _quantity


class RayPodSpec(_Strict):
    """CPU and memory of one Ray pod (requests equal limits; KubeRay gives Ray the pod's CPU limit as ``num-cpus``)."""

    cpu: str | None = Field(
        None,
        description="CPU request and limit, e.g. '8' (head default '2'; worker default: "
        "execution.num_cpus_per_replica rounded up).",
    )
    memory: str | None = Field(
        None,
        description="Memory request and limit, e.g. '64Gi' (head default '8Gi'; worker default: kubernetes.memory).",
    )

    @field_validator("cpu", "memory")
    @classmethod
    def _quantities(cls, v: str | None, info) -> str | None:
        return _quantity(v, info.field_name)


class KubeRaySpec(_Strict):
    """The generation stages on Kubernetes as a KubeRay ``RayJob`` (needs the KubeRay operator, v1.1 or later).

    Everything the pods share with training (namespace, image, node selectors, tolerations, affinity, service
    account, volumes, ``env`` and ``secret_env``) comes from the campaign's ``kubernetes:`` section; this
    section adds what a Ray cluster needs beyond it. Worker pods: ``execution.replicas``, one model replica
    each, with ``execution.num_gpus_per_replica`` (rounded up) GPUs of ``kubernetes.gpu_resource``.
    """

    ray_cluster: str | None = Field(
        None,
        description="Name of a long-lived RayCluster (in kubernetes.namespace) to submit the job to instead of "
        "creating a cluster for it (RayJob `clusterSelector`); its own pods, image and sizes apply.",
    )
    image: str | None = Field(
        None,
        description="Image of the Ray pods (default: kubernetes.image): the project installed on a Ray "
        "image whose `ray` is `ray_version`, with `wget` for KubeRay's probes (docs/scaleout.md).",
    )
    ray_version: str = Field(
        "2.60.0",
        description="Ray version of the image (RayJob rayClusterSpec.rayVersion); "
        "must equal the `ray` the project pins.",
    )
    head: RayPodSpec | None = Field(
        None,
        description="Head pod size (default cpu '2', memory '8Gi'); the head runs "
        "the job's driver, no replica unless `head_runs_replicas`.",
    )
    worker: RayPodSpec | None = Field(None, description="Worker pod size (one replica per worker pod).")
    head_runs_replicas: bool = Field(
        False,
        description="Let Ray place replicas on the head pod too (false: the head "
        "advertises 0 CPUs and only drives the job).",
    )
    shutdown_after_job_finishes: bool = Field(
        True,
        description="Delete the job's Ray cluster when the job ends (RayJob shutdownAfterJobFinishes); the "
        "launcher also deletes the RayJob when the stage ends, fails or is cancelled.",
    )
    ttl_seconds_after_finished: int = Field(
        600, ge=0, description="Seconds KubeRay keeps a finished job's cluster before deleting it (a backstop)."
    )
    active_deadline_seconds: int | None = Field(
        None, ge=1, description="KubeRay fails the job after this many seconds (RayJob activeDeadlineSeconds)."
    )

    @field_validator("ray_cluster")
    @classmethod
    def _cluster_name(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 63 or not K8S_NAME.match(v)):
            raise ValueError(f"ray_cluster must be a RayCluster name (lowercase letters, digits, '-'), got {v!r}")
        return v

    @model_validator(mode="after")
    def _long_lived_cluster_brings_its_pods(self) -> KubeRaySpec:
        if self.ray_cluster is not None:
            own = [f for f in ("image", "head", "worker") if getattr(self, f) is not None]
            own += ["head_runs_replicas"] if self.head_runs_replicas else []
            if own:
                raise ValueError(
                    f"execution.kuberay.ray_cluster is set, so the job runs on the pods of RayCluster "
                    f"{self.ray_cluster}, which has its own image and sizes: remove "
                    f"{', '.join('execution.kuberay.' + f for f in own)}"
                )
        return self


class ExecutionSpec(_Strict):
    """Where the generation stages run: `local` (one process, the default) or `ray` (shards on an actor pool)."""

    executor: Literal["local", "ray"] = Field(
        "local",
        description="local: each generation stage runs in its own process; ray: its prompts are split into "
        "shards run by `replicas` actors of a Ray cluster, each holding one model replica.",
    )
    ray_address: str | None = Field(
        None,
        description="The Ray cluster to use (`auto`, `host:6379` or `ray://host:10001`); empty: the stage starts "
        "a local cluster with this machine's CPUs and stops it when done.",
    )
    replicas: int = Field(
        2, ge=1, description="Actors (model replicas) in the pool; more than the cluster can place wait for room."
    )
    num_cpus_per_replica: float = Field(
        1.0, gt=0, description="CPUs Ray reserves for each replica (and the torch threads it runs with)."
    )
    num_gpus_per_replica: float = Field(0.0, ge=0, description="GPUs Ray reserves for each replica (0: CPU replicas).")
    shard_prompts: int = Field(
        64, ge=1, description="Prompts per shard: the unit that is cached, retried and billed as one."
    )
    max_shard_retries: int = Field(
        3, ge=0, description="Times a shard lost with its worker is run again before the stage fails."
    )
    kuberay: KubeRaySpec | None = Field(
        None,
        description="Run the generation stages on Kubernetes as KubeRay RayJobs the stages launch, follow and "
        "delete (with the campaign's `kubernetes:` section; docs/scaleout.md). Rendered by "
        "`campaign k8s-render`. Empty: Ray runs where the stage runs.",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_spelling(cls, data: Any) -> Any:
        """``execution.engine`` (before issue 44) is read as ``execution.executor``, with a warning naming it."""
        if not isinstance(data, dict) or "engine" not in data:
            return data
        if "executor" in data:
            raise ValueError(
                "execution.engine is the old name of execution.executor and both are set; keep only "
                f"`executor: {data['executor']}`"
            )
        data = dict(data)
        old = data.pop("engine")
        warnings.warn(
            f"execution.engine is renamed execution.executor: write `executor: {old}` (the old spelling is still "
            "read, for now)",
            FutureWarning,
            stacklevel=2,
        )
        return data | {"executor": old}

    @property
    def gpus_per_worker_pod(self) -> int:
        """GPUs of one KubeRay worker pod: one replica's, rounded up to whole devices."""
        return math.ceil(self.num_gpus_per_replica)

    @model_validator(mode="after")
    def _kuberay_runs_ray(self) -> ExecutionSpec:
        if self.kuberay is not None and self.executor != "ray":
            raise ValueError(
                "execution.kuberay runs the generation stages on a KubeRay cluster, which needs "
                "execution.executor: ray; set it, or remove execution.kuberay"
            )
        if self.kuberay is not None and self.ray_address:
            raise ValueError(
                "execution.kuberay and execution.ray_address both say where Ray runs: inside a RayJob the "
                "job connects to its own cluster; remove execution.ray_address (or execution.kuberay to "
                "use the cluster at that address from where the stage runs)"
            )
        return self
