"""What the two Kubernetes launchers share (training's :class:`~resources.k8s.launcher.K8sTrainingLauncher`, the
generation stages' :class:`~resources.k8s.kuberay_launcher.KubeRayJobLauncher`): how to reach the cluster (kubeconfig,
context, in-cluster), how a launch watches its workload (polling, the pending and image-pull limits, the overall
timeout, failed API reads, log tails and drain), the API client, the run pod as the owner of what a run creates, and the
cluster named in the run's owner record before anything is created. Each launcher keeps its own defaults and words
where they differ (what it deletes, whose logs it echoes, how long an image pull may take). The watch loop these
settings drive, its pod failures and its clean-up are shared too: ``watch.py``.

The Kubernetes client is imported inside the methods: a code location that never launches on Kubernetes never
imports it."""

from __future__ import annotations

import os

from dagster import ConfigurableResource
from pydantic import Field

from resources import run_owner


class KubernetesLauncher(ConfigurableResource):
    """The connection and watch settings of a launcher that runs a workload on Kubernetes."""

    kubeconfig_file: str | None = Field(
        None, description="Kubeconfig to use; default: in-cluster config when running in a pod, else ~/.kube/config."
    )
    kube_context: str | None = Field(None, description="Kubeconfig context; default: the current one.")
    in_cluster: bool | None = Field(None, description="Force (true) or forbid (false) in-cluster config; null: auto.")
    poll_interval_s: float = Field(2.0, gt=0, description="Seconds between two looks at the workload and its pods.")
    pending_timeout_s: float = Field(1800, gt=0, description="Fail when a pod stays unschedulable this long.")
    image_pull_timeout_s: float = Field(300, gt=0, description="Fail when an image cannot be pulled for this long.")
    timeout_s: float = Field(7 * 24 * 3600, gt=0, description="Stop the job after this many seconds.")
    log_tail_lines: int = Field(40, ge=1, description="Last log lines of a failed pod shown in the failure.")
    log_drain_timeout_s: float = Field(60, ge=0, description="Wait this long for the last log lines after success.")
    api_error_budget: int = Field(5, ge=0, description="Consecutive failed API reads tolerated before failing.")
    delete_on_success: bool = Field(True, description="Delete the workload when it succeeds.")
    echo_logs: bool = Field(True, description="Copy pod log lines to the step's stdout (captured by Dagster).")
    owned_by_run_pod: bool = Field(
        True, description="When the Dagster run pod is in the workload's namespace, make it the owner of the workload."
    )

    # ------------------------------------------------------------------ API
    def api_client(self):
        from kubernetes import client, config

        auto_in_cluster = (
            self.in_cluster is None and not self.kubeconfig_file and os.environ.get("KUBERNETES_SERVICE_HOST")
        )
        if self.in_cluster or auto_in_cluster:
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        return config.new_client_from_config(config_file=self.kubeconfig_file, context=self.kube_context)

    def run_pod_owner(self, core, namespace: str) -> dict[str, str] | None:
        """{name, uid} of the pod this code runs in, if it is a pod of ``namespace`` (else None)."""
        pod = os.environ.get("HOSTNAME")
        if not (self.owned_by_run_pod and pod and os.environ.get("KUBERNETES_SERVICE_HOST")):
            return None
        try:
            me = core.read_namespaced_pod(pod, namespace)
        except Exception:  # another namespace, or no permission: ttlSecondsAfterFinished remains the backstop
            return None
        return {"name": me.metadata.name, "uid": me.metadata.uid}

    def _record_cluster(self, context, namespace: str) -> None:
        """Name the cluster in the run's owner record (``resources/run_owner.py``: ``k8s``) before anything is
        created: the reaper deletes the run's workloads there if this process dies without cleaning up."""
        where = {
            "namespace": namespace,
            "kubeconfig_file": self.kubeconfig_file,
            "kube_context": self.kube_context,
            "in_cluster": self.in_cluster,
        }
        try:
            tags = context.instance.get_run_by_id(context.run_id).tags
            context.instance.add_run_tags(context.run_id, run_owner.updated(tags, k8s=where))
        except Exception as e:  # noqa: BLE001 - a bare context without a stored run
            context.log.debug(f"could not record the cluster in the run's tags: {e}")
