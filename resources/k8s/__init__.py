"""Kubernetes: multi-node training launched from Dagster (see ``launcher.py``).

``manifests`` and ``status`` are pure (no Kubernetes client); ``launcher`` and ``logs`` import the
``kubernetes`` client only inside the methods that talk to a cluster, so importing this package
(and the code location) never needs it.
"""

from resources.k8s.launcher import K8sTrainingLauncher
from resources.k8s.manifests import Workload, build_manifests, workload_name

__all__ = ["K8sTrainingLauncher", "Workload", "build_manifests", "workload_name"]
