"""The ``launcher`` resource: each campaign's ``training.launcher`` picks local torchrun or Kubernetes.

One code location holds campaigns of both kinds (the CPU demo and a cluster campaign), so the
choice is made per launch from the TrainJob, not per deployment.
"""

from __future__ import annotations

from pathlib import Path

from dagster import ConfigurableResource, Failure
from pydantic import Field

from campaigns.spec import KubernetesSpec
from resources.k8s.launcher import K8sTrainingLauncher
from resources.local_launcher import LocalTorchrunLauncher


class TrainingLauncher(ConfigurableResource):
    """Routes a training launch to `local` (torchrun subprocesses) or `k8s` (a Kubernetes workload)."""

    local: LocalTorchrunLauncher = Field(description="Launcher for `training.launcher: local`.")
    k8s: K8sTrainingLauncher = Field(description="Launcher for `training.launcher: k8s`.")

    def launch(self, context, job, workdir: Path, kubernetes: KubernetesSpec | None = None, budget=None) -> dict:
        if job.training.launcher == "k8s":
            if kubernetes is None:
                raise Failure(
                    f"campaign {job.campaign}: training.launcher is 'k8s' but no `kubernetes:` section "
                    f"was passed to the launcher"
                )
            return self.k8s.launch(context, job, workdir, kubernetes, budget=budget)
        return self.local.launch(context, job, workdir, budget=budget)
