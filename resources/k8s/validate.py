"""Offline schema checks for rendered manifests (``kubernetes-validate``, strict mode).

Built-in kinds (Job, Service) are validated against the Kubernetes OpenAPI schema that
``kubernetes-validate`` ships for each minor version (1.25 to 1.37 in 1.37.0), in strict mode:
an unknown or misspelled field is an error. The Kubeflow ``PyTorchJob`` is a custom resource with
no schema there, so its envelope is checked against the field names of the training operator's
``kubeflow.org/v1`` API (``PYTORCHJOB_SCHEMA`` below) and each replica's pod template is validated
as a core ``v1 PodTemplate``, strict, like the built-in kinds. A KubeRay ``RayJob`` is checked the
same way against the CRD's own schema (``kuberay_schema.py``, vendored from KubeRay).
"""

from __future__ import annotations

from typing import Any

DEFAULT_VERSIONS = ("1.29", "1.37")  # oldest and newest minor commonly run by GPU clouds, both shipped offline

_REPLICA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["replicas", "template"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object"},
    },
}

# Field names of kubeflow.org/v1 PyTorchJob (training operator v1.x API: PyTorchJobSpec, RunPolicy, ReplicaSpec).
PYTORCHJOB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["pytorchReplicaSpecs"],
            "properties": {
                "nprocPerNode": {"type": "string"},
                "elasticPolicy": {"type": "object"},
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                        "backoffLimit": {"type": "integer", "minimum": 0},
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                        "managedBy": {"type": "string"},
                        "schedulingPolicy": {"type": "object"},
                        "suspend": {"type": "boolean"},
                        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                    },
                },
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["Master"],
                    "properties": {"Master": _REPLICA, "Worker": _REPLICA},
                },
            },
        },
    },
}


class ManifestError(ValueError):
    """A rendered manifest does not match the Kubernetes schema."""


def _where(err) -> str:
    return "/".join(str(p) for p in err.absolute_path) or "<root>"


def validate_manifest(manifest: dict[str, Any], version: str = DEFAULT_VERSIONS[-1]) -> None:
    """Raise ``ManifestError`` naming the object, the field path and the schema version."""
    import jsonschema
    import kubernetes_validate

    name = f"{manifest.get('kind')}/{manifest.get('metadata', {}).get('name')}"
    if manifest.get("kind") == "RayJob":
        validate_rayjob(manifest, version)
        return
    if manifest.get("kind") == "PyTorchJob":
        try:
            jsonschema.validate(manifest, PYTORCHJOB_SCHEMA)
        except jsonschema.ValidationError as e:
            raise ManifestError(f"{name}: {_where(e)}: {e.message} (kubeflow.org/v1 PyTorchJob)") from e
        # metadata is a standard ObjectMeta: check it strictly by wrapping it in a ConfigMap
        validate_manifest({"apiVersion": "v1", "kind": "ConfigMap", "metadata": manifest["metadata"]}, version)
        for role, replica in manifest["spec"]["pytorchReplicaSpecs"].items():
            tpl = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{name}-{role}".lower().replace("/", "-")},
                "template": replica["template"],
            }
            try:
                kubernetes_validate.validate(tpl, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                raise ManifestError(
                    f"{name}: spec/pytorchReplicaSpecs/{role}/{_where(e)}: {e.message} (Kubernetes {e.version}, strict)"
                ) from e
        return
    try:
        kubernetes_validate.validate(manifest, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise ManifestError(f"{name}: {_where(e)}: {e.message} (Kubernetes {e.version}, strict)") from e


def validate_rayjob(manifest: dict[str, Any], version: str = DEFAULT_VERSIONS[-1]) -> None:
    """A KubeRay ``RayJob``: its fields against the CRD's schema (``kuberay_schema``), its metadata as a strict
    ObjectMeta, each pod template (head, worker groups) as a strict core ``v1 PodTemplate``."""
    import jsonschema
    import kubernetes_validate

    from resources.k8s.kuberay_schema import RAYJOB_V1_SCHEMA, SOURCE, pod_templates

    name = f"RayJob/{manifest.get('metadata', {}).get('name')}"
    try:
        jsonschema.validate(manifest, RAYJOB_V1_SCHEMA)
    except jsonschema.ValidationError as e:
        raise ManifestError(f"{name}: {_where(e)}: {e.message} (KubeRay CRD schema: {SOURCE})") from e
    validate_manifest({"apiVersion": "v1", "kind": "ConfigMap", "metadata": manifest["metadata"]}, version)
    for where, template in pod_templates(manifest):
        tpl = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "ray-pod-template"},
            "template": template,
        }
        try:
            kubernetes_validate.validate(tpl, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise ManifestError(
                f"{name}: {where}/{_where(e).removeprefix('template/')}: {e.message} (Kubernetes {e.version}, strict)"
            ) from e


def validate_manifests(manifests: list[dict[str, Any]], versions: tuple[str, ...] = DEFAULT_VERSIONS) -> list[str]:
    """Validate every manifest against every version; return the versions checked."""
    for v in versions:
        for m in manifests:
            validate_manifest(m, v)
    return list(versions)
