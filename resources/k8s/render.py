"""``campaign k8s-render FILE``: the manifests a campaign's training launch creates, as YAML.

For review and for ``kubectl apply --dry-run=server -f -`` against a real cluster. The launcher
adds the Dagster Pipes bootstrap variables and the run id at launch time; here the run id is
``manual`` and the TrainJob path is a placeholder on the artifacts volume. A campaign with
``execution.kuberay`` also gets one KubeRay ``RayJob`` per generation stage (``kuberay.py``), checked
against the KubeRay CRD's schema.
"""

from __future__ import annotations

import sys
from typing import Any

from campaigns.spec import CampaignSpec
from resources.k8s.manifests import Workload, build_manifests, workload_name


def campaign_manifests(
    spec: CampaignSpec, run_id: str = "manual", salt: str = "00000", pipes_env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    if spec.kubernetes is None:
        raise ValueError(f"campaign {spec.name} has no `kubernetes:` section; nothing to render")
    root = spec.kubernetes.artifacts.mount_path.rstrip("/")
    w = Workload(
        campaign=spec.name,
        training=spec.training,
        cluster=spec.kubernetes,
        job_file=f"{root}/{spec.name}/student_adapter/<stage-key>/train_job.json",
        name=workload_name(spec.name, run_id, salt),
        run_id=run_id,
        asset_key=f"{spec.name}/student_adapter",
        pipes_env=pipes_env or {},
    )
    return build_manifests(w)


def render_command(args) -> int:
    import yaml

    from campaigns.loader import CampaignError, resolve_campaign

    try:
        spec, _ = resolve_campaign(args.campaign)
    except (CampaignError, KeyError) as e:
        print(f"invalid campaign:\n{e}", file=sys.stderr)
        return 1
    try:
        from resources.k8s.kuberay import campaign_ray_jobs

        manifests = campaign_manifests(spec) + campaign_ray_jobs(spec)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 1
    if not args.no_validate:
        from resources.k8s.validate import DEFAULT_VERSIONS, ManifestError, validate_manifests

        try:
            versions = validate_manifests(manifests, tuple(args.k8s_version or DEFAULT_VERSIONS))
        except ManifestError as e:
            print(f"invalid manifest: {e}", file=sys.stderr)
            return 1
        ray = " and the KubeRay RayJob CRD (ray.io/v1)" if any(m["kind"] == "RayJob" for m in manifests) else ""
        print(f"# valid against the Kubernetes {', '.join(versions)} schemas{ray} (strict, offline)", file=sys.stderr)
    sys.stdout.write(yaml.safe_dump_all(manifests, sort_keys=False))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "k8s-render", help="print the Kubernetes manifests of a campaign's training launch (and its KubeRay RayJobs)"
    )
    p.add_argument("campaign", help="campaign name or YAML file (e.g. campaigns/examples/cluster.yaml)")
    p.add_argument("--k8s-version", action="append", help="schema version(s) to validate against, e.g. 1.30")
    p.add_argument("--no-validate", action="store_true", help="skip the offline schema check")
    p.set_defaults(fn=render_command)
