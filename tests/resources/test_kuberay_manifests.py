"""KubeRay RayJob manifests (pure) from a campaign, the `execution.kuberay` section, and the offline check
against the KubeRay CRD's schema (vendored subset, jsonschema) plus the core PodTemplate schema (strict)."""

from __future__ import annotations

import argparse
import copy
import json

import pytest
import yaml

from campaigns.loader import CampaignError, load_campaign_file, parse_campaign_text
from resources.k8s import kuberay as kr
from resources.k8s.render import render_command
from resources.k8s.validate import ManifestError, validate_manifest, validate_manifests
from tests.support import REPO_ROOT

EXAMPLE = REPO_ROOT / "campaigns/examples/cluster_ray.yaml"
RUN_ID = "4f3c2b1a-0000-4000-8000-123456789abc"


@pytest.fixture(scope="module")
def example():
    return load_campaign_file(EXAMPLE)


def _reparsed(spec, mutate):
    raw = spec.model_dump(mode="json", exclude_none=True)
    mutate(raw)
    return parse_campaign_text(yaml.safe_dump(raw), "cluster_ray.yaml")


def _job(spec, **over) -> dict:
    w = kr.RayWorkload(
        spec=spec,
        stage="teacher_generations",
        job_file="/app/artifacts/x/ray_job.json",
        name=kr.rayjob_name(spec.name, "teacher_generations", RUN_ID, "a1b2c"),
        run_id=RUN_ID,
        asset_key=f"{spec.name}/teacher_generations",
        pipes_env={
            "DAGSTER_PIPES_CONTEXT": "eJzLSM3JyQcABiwCFQ==",
            "DAGSTER_PIPES_MESSAGES": "eJyrVgrJzC0oSg0uKcpMUbKqBgBFlQbY",
        },
        **over,
    )
    return kr.ray_job(w)


def test_example_renders_a_valid_rayjob_with_gpu_replicas(example):
    job = _job(example)
    assert validate_manifests([job], ("1.29", "1.37")) == ["1.29", "1.37"]
    assert (job["apiVersion"], job["kind"], job["metadata"]["namespace"]) == ("ray.io/v1", "RayJob", "training")
    spec = job["spec"]
    assert spec["entrypoint"] == (
        "python -m campaign_orchestrator.generation.scaleout --job /app/artifacts/x/ray_job.json "
        "--summary /app/artifacts/x/ray_summary.json"
    )
    assert (
        spec["submissionMode"],
        spec["shutdownAfterJobFinishes"],
        spec["ttlSecondsAfterFinished"],
        spec["activeDeadlineSeconds"],
    ) == ("K8sJobMode", True, 600, 86400)
    rc = spec["rayClusterSpec"]
    assert rc["rayVersion"] == "2.60.0" and rc["enableInTreeAutoscaling"] is False
    (group,) = rc["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (8, 8, 8)  # execution.replicas
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"] == {
        "requests": {"nvidia.com/gpu": "1", "cpu": "8", "memory": "120Gi"},
        "limits": {"nvidia.com/gpu": "1", "cpu": "8", "memory": "120Gi"},
    }
    head = rc["headGroupSpec"]
    assert head["rayStartParams"] == {"dashboard-host": "0.0.0.0", "num-cpus": "0"}  # the head only drives the job
    head_c = head["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head_c["resources"]["limits"] and head_c["resources"]["limits"]["cpu"] == "4"
    for tpl in (head["template"], group["template"]):  # the kubernetes: section, as training's pods get it
        pod = tpl["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert pod["tolerations"] == [{"operator": "Exists", "key": "nvidia.com/gpu", "effect": "NoSchedule"}]
        assert pod["serviceAccountName"] == "campaign-trainer"
        assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
        assert {"name": "artifacts", "mountPath": "/app/artifacts"} in pod["containers"][0]["volumeMounts"]
        assert pod["containers"][0]["image"] == "ghcr.io/example/campaign-orchestrator:0.1.0-cu128"
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        assert env["HF_TOKEN"] == {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "huggingface", "key": "token", "optional": True}},
        }
        assert "DAGSTER_PIPES_CONTEXT" not in env  # Pipes goes to the driver only, through the runtime env
        assert tpl["metadata"]["labels"]["dagster/run-id"] == RUN_ID[:63]
    assert yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]["DAGSTER_PIPES_CONTEXT"] == "eJzLSM3JyQcABiwCFQ=="


def test_entrypoint_is_what_the_scaleout_module_parses(example):
    """The RayJob's entrypoint is the real ``python -m campaign_orchestrator.generation.scaleout`` command line."""
    from campaign_orchestrator.generation.scaleout.__main__ import parse_args

    words = _job(example)["spec"]["entrypoint"].split()
    assert words[:3] == ["python", "-m", "campaign_orchestrator.generation.scaleout"]
    args = parse_args(words[3:])
    assert (args.job, args.summary, args.address) == (
        "/app/artifacts/x/ray_job.json",
        "/app/artifacts/x/ray_summary.json",
        "auto",
    )


def test_labels_carry_the_run_stage_and_asset(example):
    meta = _job(example)["metadata"]
    assert meta["labels"]["dagster/run-id"] == RUN_ID and meta["labels"]["app.kubernetes.io/component"] == "ray"
    assert meta["labels"]["dagster/asset-key"] == "cluster_ray_distill.teacher_generations"
    assert meta["labels"]["campaign-orchestrator/stage"] == "teacher_generations"
    assert meta["labels"]["team"] == "ml-platform"  # kubernetes.labels
    owned = _job(example, owner={"name": "dagster-run-abc", "uid": "u-1"})["metadata"]["ownerReferences"]
    assert owned == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "dagster-run-abc",
            "uid": "u-1",
            "blockOwnerDeletion": False,
            "controller": False,
        }
    ]


def test_schema_check_fails_on_a_wrong_field(example):
    """The vendored CRD schema catches a misspelled or mistyped field the Kubernetes schemas cannot see."""
    good = _job(example)
    validate_manifest(good)

    def broken(edit):
        m = copy.deepcopy(good)
        edit(m)
        with pytest.raises(ManifestError) as e:
            validate_manifest(m)
        return str(e.value)

    msg = broken(lambda m: m["spec"].update(shutdownAfterJobFinish=True))  # the field is shutdownAfterJobFinishes
    assert "RayJob/" in msg and "shutdownAfterJobFinish" in msg and "KubeRay CRD schema" in msg
    msg = broken(lambda m: m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replica=8))
    assert "spec/rayClusterSpec/workerGroupSpecs/0" in msg and "replica" in msg
    assert "'8' is not of type 'integer'" in broken(
        lambda m: m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas="8")
    )
    assert "'rayStartParams' is a required property" in broken(
        lambda m: m["spec"]["rayClusterSpec"]["headGroupSpec"].pop("rayStartParams")
    )
    assert "'entrypoint' is a required property" in broken(lambda m: m["spec"].pop("entrypoint"))
    assert "2147483648" in broken(lambda m: m["spec"].update(ttlSecondsAfterFinished=2**31))  # int32
    # the pod templates: checked as core PodTemplates, strict
    msg = broken(
        lambda m: m["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"].update(nodeSelecter={"a": "b"})
    )
    assert "spec/rayClusterSpec/workerGroupSpecs/0/template" in msg and "nodeSelecter" in msg
    msg = broken(
        lambda m: m["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(
            volumeMount=[]
        )
    )  # the field is volumeMounts
    assert "headGroupSpec/template" in msg and "volumeMount" in msg
    assert "annotation" in broken(lambda m: m["metadata"].update(annotation={}))  # metadata: a strict ObjectMeta


def test_long_lived_ray_cluster_gets_a_cluster_selector_and_no_cluster(example):
    spec = _reparsed(example, lambda raw: raw["execution"].update(kuberay={"ray_cluster": "shared-ray"}))
    job = _job(spec)
    validate_manifest(job)
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": "shared-ray"}
    assert "rayClusterSpec" not in job["spec"] and "shutdownAfterJobFinishes" not in job["spec"]


def test_cpu_replicas_and_sizes(example):
    def cpu(raw):
        raw["execution"].update(num_gpus_per_replica=0, num_cpus_per_replica=1.5, replicas=3)
        raw["execution"]["kuberay"] = {"head_runs_replicas": True, "image": "example/ray-cpu:1"}
        raw["kubernetes"].pop("memory")

    job = _job(_reparsed(example, cpu))
    validate_manifest(job)
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    c = group["template"]["spec"]["containers"][0]
    assert group["replicas"] == 3 and c["resources"]["limits"] == {"cpu": "2"} and c["image"] == "example/ray-cpu:1"
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert "num-cpus" not in head["rayStartParams"] and head["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "2", "memory": "8Gi"},
        "limits": {"cpu": "2", "memory": "8Gi"},
    }
    two = _job(_reparsed(example, lambda raw: raw["execution"].update(num_gpus_per_replica=1.5)))
    assert (
        two["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"][
            "limits"
        ]["nvidia.com/gpu"]
        == "2"
    )  # rounded up to whole devices
    no_gpu_resource = _reparsed(example, lambda raw: raw["kubernetes"].update(gpu_resource=None))
    with pytest.raises(ValueError, match="kubernetes.gpu_resource is null"):
        _job(no_gpu_resource)


def test_names_fit_kuberay_limits():
    name = kr.rayjob_name("a_very_long_campaign_name_indeed_yes", "teacher_generations", RUN_ID, "a1b2c3")
    assert len(name) <= 47 and name == "ray-a-very-long-camp-gen-4f3c2b1a-a1b2c"
    assert kr.rayjob_name("demo", "evaluation", "", "x") == "ray-demo-eval-manual-x"


def test_spec_errors_name_the_field_and_what_to_write(example, tmp_path):
    raw = yaml.safe_load(EXAMPLE.read_text())

    def error(mutate) -> str:
        doc = copy.deepcopy(raw)
        mutate(doc)
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(doc))
        with pytest.raises(CampaignError) as e:
            load_campaign_file(path)
        return str(e.value)

    msg = error(lambda d: d["execution"].update(executor="local"))
    assert "c.yaml" in msg and "execution" in msg and "needs execution.executor: ray" in msg
    msg = error(lambda d: d["execution"].update(ray_address="ray://head:10001"))
    assert "remove execution.ray_address" in msg
    msg = error(lambda d: d["execution"]["kuberay"].update(ray_cluster="shared-ray"))
    assert "remove execution.kuberay.head, execution.kuberay.worker" in msg
    msg = error(lambda d: (d.pop("kubernetes"), d["training"].update(launcher="local")))
    assert "execution.kuberay" in msg and "no `kubernetes:` section" in msg
    msg = error(lambda d: d["execution"]["kuberay"]["worker"].update(memory="lots"))
    assert "execution.kuberay.worker.memory" in msg and "Kubernetes quantity" in msg


def test_rendering_never_reads_secret_values(example, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_PLANTED_SECRET_value_in_the_dagster_env")
    assert "PLANTED" not in json.dumps(kr.campaign_ray_jobs(example))


def test_rayjob_state():
    assert kr.rayjob_state({})[0] == "running"
    assert kr.rayjob_state({"status": {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"}})[0] == "running"
    assert kr.rayjob_state({"status": {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}})[0] == "succeeded"
    state, why = kr.rayjob_state({"status": {"jobStatus": "FAILED", "message": "driver exited 1"}})
    assert state == "failed" and "driver exited 1" in why
    state, why = kr.rayjob_state({"status": {"jobDeploymentStatus": "Failed", "message": "activeDeadlineSeconds"}})
    assert state == "failed" and "jobDeploymentStatus Failed" in why  # never started: no jobStatus at all


def test_render_cli_shows_the_rayjobs_and_checks_them(capsys):
    assert render_command(argparse.Namespace(campaign=str(EXAMPLE), no_validate=False, k8s_version=None)) == 0
    out, err = capsys.readouterr()
    kinds = [m["kind"] for m in yaml.safe_load_all(out)]
    assert kinds == ["Service", "Job", "RayJob", "RayJob"]  # training, then one RayJob per generation stage
    assert "KubeRay RayJob CRD" in err
    # a campaign without execution.kuberay renders training only, as before
    assert (
        render_command(
            argparse.Namespace(
                campaign=str(REPO_ROOT / "campaigns/examples/cluster.yaml"), no_validate=True, k8s_version=None
            )
        )
        == 0
    )
    assert [m["kind"] for m in yaml.safe_load_all(capsys.readouterr()[0])] == ["Service", "Job"]
