"""Launch a generation stage as a KubeRay ``RayJob`` and follow it from Dagster (``execution.kuberay``).

Lifecycle of one launch (``KubeRayJobLauncher.launch``), the training launcher's (``launcher.py``) for a RayJob; the
watch, the failure of a pod and the clean-up are the ones both launchers share (``watch.py``), in this launcher's
words (``_RayJobWatch``):

1. Check that every path the job needs (JOB.json, the prompts, the output, the generation cache, the model
   checkpoint and adapter its workers load) lies on a volume the Ray pods mount, write ``ray_job.json`` there,
   and open a Pipes session (the context in the job's runtime environment, the messages read from the submitter
   pod's log).
2. Name the cluster in the run's owner record (``campaign/owner``: the reaper's pointer), then create the ``RayJob``
   (``kuberay.ray_job``), labelled with the campaign, the Dagster run id, the stage and the asset key.
3. Poll the RayJob and its pods: follow the submitter pod's log as soon as it starts (the driver's Pipes
   messages stream into the asset: shard progress as log lines, the result as the materialization's metadata);
   fail at once, with the pod, the reason and its last log lines, when the head or the submitter dies or a pod
   can never start (a missing Secret, a bad image name); fail when a pod stays unschedulable or its image
   cannot be pulled for too long. A *worker* pod that dies is only reported: Ray retries its shards on the
   other workers (only the prompts in flight are asked again) and KubeRay replaces the pod. The driver's
   ``ray_shard`` messages (one per finished shard: its tokens and seconds) are charged to the campaign's budget
   guard as they arrive and its ``ray_plan`` message checks the guard's planner estimate for the uncached share;
   every poll also checks the guard (the stage's spend so far) and the launcher's timeout.
4. Delete the RayJob when the stage succeeds, fails, is stopped by its budget or the Dagster run is cancelled;
   KubeRay's owner references take the job's Ray cluster and submitter with it (``ttlSecondsAfterFinished`` and
   ``shutdownAfterJobFinishes`` are the backstops). When the process running the launch dies, the stale-run
   reaper deletes the run's RayJobs by their ``dagster/run-id`` label (``launcher.delete_run_workloads``).

Why the project's launcher and not ``dagster_ray.kuberay.PipesKubeRayJobClient`` (dagster-ray 0.4.8): that client
reads Pipes messages through the Ray dashboard's job API (``JobSubmissionClient``), so the Dagster pod must reach
the head's dashboard port (in-cluster DNS or a ``kubectl port-forward``), where this launcher reads the submitter
pod's log through the Kubernetes API, the one path training already uses and the emulated API serves in tests;
it requires ``spec.rayClusterSpec`` (it rewrites the images there), so it cannot submit to a long-lived
``RayCluster`` (``clusterSelector``); on cancellation it stops the Ray job through the dashboard and leaves the
``RayJob`` object, on failure it leaves it to its TTL; and it knows nothing of the stale-run reaper (no run tag
naming the cluster), of pods that can never start, or of the budget guard. docs/scaleout.md has the comparison.

The Kubernetes client is imported inside the methods: a code location that never launches on Kubernetes never
imports it.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from dagster import AssetObservation, Failure, MetadataValue
from pydantic import Field

from campaigns.spec import CampaignSpec
from resources.k8s import kuberay as kr
from resources.k8s import manifests as mf
from resources.k8s.connection import KubernetesLauncher
from resources.k8s.status import PodProblem, pod_finished, pod_name
from resources.k8s.watch import WorkloadWatch, list_pods, pipes_session
from stages.pricing import charge_shard

# paths inside JOB.json the Ray pods open (campaign_orchestrator/generation/scaleout/job.py): the prompts, the output,
# the
# generation cache, and the model a worker loads (a backend recipe's checkpoint; an answering model's base and
# adapter); s3:// URIs need no volume
JOB_PATHS = (
    ("prompts",),
    ("output",),
    ("cache", "store_url"),
    ("cache", "spool_dir"),
    ("recipe", "model_path"),
    ("recipe", "generator", "model_dir"),
    ("recipe", "generator", "adapter_dir"),
)


def job_paths(job: dict[str, Any]) -> dict[str, str]:
    """``field=path`` of the local paths a JOB.json names (URIs such as ``s3://`` left out)."""
    out = {}
    for keys in JOB_PATHS:
        v: Any = job
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        if isinstance(v, str) and v and "://" not in v:
            out[".".join(keys)] = v
    return out


class KubeRayJobLauncher(KubernetesLauncher):
    """Runs one generation stage as a KubeRay RayJob (a Ray cluster for the job, or a long-lived RayCluster)."""

    poll_interval_s: float = Field(2.0, gt=0, description="Seconds between two looks at the RayJob and its pods.")
    image_pull_timeout_s: float = Field(
        600, gt=0, description="Fail when an image cannot be pulled for this long (Ray GPU images are large)."
    )
    delete_on_success: bool = Field(True, description="Delete the RayJob (and so its cluster) when the stage succeeds.")
    echo_logs: bool = Field(True, description="Copy the submitter's log lines to the step's stdout.")
    owned_by_run_pod: bool = Field(
        True,
        description="When the Dagster run pod is in the job's namespace, make it the "
        "owner of the RayJob (deleted with the run pod if it dies).",
    )

    # ------------------------------------------------------------------ launch
    def launch(
        self, context, spec: CampaignSpec, stage: str, job: dict[str, Any], workdir: Path, budget=None, on_shard=None
    ) -> dict:
        """Run ``job`` (a JOB.json as a dict: ``campaign_orchestrator.generation.scaleout.job.Job``) as a RayJob for
        ``stage`` of
        ``spec``; return the job's summary (``ray_summary.json`` beside JOB.json: rows, tokens, shards, nodes, lost
        workers, as ``python -m campaign_orchestrator.generation.scaleout --summary`` writes it), the submitter's log,
        the
        driver's Pipes metadata and the RayJob's name.

        ``budget``: a ``campaign_orchestrator.costs.budget.BudgetGuard``, charged with each finished shard's usage
        (the driver's ``ray_shard`` messages) as it arrives and checked at every poll; when it stops the stage, the
        RayJob is deleted (its pods get SIGTERM; finished shards are in the cache) and its failure raised.
        ``on_shard(message)``: called with each ``ray_shard`` message after the charge (progress)."""
        if spec.execution.kuberay is None or spec.kubernetes is None:
            raise Failure(f"campaign {spec.name}: a KubeRay launch needs execution.kuberay and a `kubernetes:` section")
        cluster = spec.kubernetes
        workdir = Path(workdir)
        job_file = workdir / "ray_job.json"
        bad = mf.unreachable_paths({**job_paths(job), "ray_job_file": str(job_file)}, cluster)
        if bad:
            raise Failure(
                f"the Ray pods cannot see {', '.join(bad)}: they mount only {mf.mount_roots(cluster)}. Put the "
                f"artifact root on the shared volume (kubernetes.artifacts, mounted at the same path in the Dagster "
                f"run pod), the generation cache on s3://, and models on that volume or on a volume of "
                f"kubernetes.volumes"
            )
        workdir.mkdir(parents=True, exist_ok=True)
        job_file.write_text(json.dumps(job, indent=2))
        Path(kr.summary_path(str(job_file))).unlink(missing_ok=True)  # an earlier attempt's summary is not this job's

        from kubernetes import client

        api = self.api_client()
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self._record_cluster(context, cluster.namespace)
        name = kr.rayjob_name(spec.name, stage, context.run_id, secrets.token_hex(3))
        asset_key = context.asset_key.to_user_string() if context.has_assets_def else ""
        extras = {"campaign": spec.name, "stage": stage, "ray_job": name}
        pipes = pipes_session(self, context, core, cluster.namespace, workdir, kr.SUBMITTER_CONTAINER, extras)
        with pipes as (session, reader):
            w = kr.RayWorkload(
                spec=spec,
                stage=stage,
                job_file=str(job_file),
                name=name,
                run_id=context.run_id,
                asset_key=asset_key,
                pipes_env=dict(session.get_bootstrap_env_vars()),
                owner=self.run_pod_owner(core, cluster.namespace) if self.owned_by_run_pod else None,
            )
            pipes_md = _RayJobWatch(self, context, core, reader, session, w, custom, budget, on_shard).launch()
        summary_file = Path(kr.summary_path(str(job_file)))
        if not summary_file.exists():
            raise Failure(
                f"RayJob {name} succeeded but wrote no {summary_file}",
                metadata={"logs": MetadataValue.json([str(p) for p in reader.log_files()])},
            )
        return {
            "summary": json.loads(summary_file.read_text()),
            "logs": [str(p) for p in reader.log_files()],
            "pipes_metadata": pipes_md,
            "ray_job": name,
            "k8s_workload": name,
            "k8s_namespace": cluster.namespace,
        }

    # ------------------------------------------------------------------ delete
    @staticmethod
    def _delete(context, custom, w: kr.RayWorkload, why: str) -> None:
        from kubernetes.client import ApiException

        try:
            custom.delete_namespaced_custom_object(
                kr.RAYJOB_GROUP,
                kr.RAYJOB_VERSION,
                w.namespace,
                kr.RAYJOB_PLURAL,
                w.name,
                propagation_policy="Background",
            )
            context.log.info(f"deleted RayJob/{w.name} ({why}); KubeRay removes its cluster and submitter")
        except ApiException as e:
            if e.status != 404:
                context.log.warning(
                    f"could not delete RayJob/{w.name} ({e.status} {e.reason}); "
                    f"ttlSecondsAfterFinished will remove its cluster"
                )
        except Exception as e:  # never hide the original error behind a cleanup error
            context.log.warning(f"could not delete RayJob/{w.name}: {e}")

    @staticmethod
    def _check_budget(context, w: kr.RayWorkload, budget, charge=None) -> None:
        """Check the guard (or run ``charge``, a charge of reported usage, which checks it too); on its budget stop
        say that the RayJob is being stopped, and let the stop propagate to ``launch``, which deletes it."""
        if budget is None:
            return
        try:
            (charge or budget.check)()
        except Exception:  # the budget stop (stages.errors.BudgetStopped)
            context.log.warning(
                f"budget: stopping RayJob {w.name} ({w.spec.execution.replicas} replica(s)); what the "
                f"workers finished is in the generation cache and is not paid again"
            )
            raise

    @classmethod
    def _stream_custom(cls, context, w: kr.RayWorkload, session, seen: int, budget=None, on_shard=None) -> int:
        """The driver's custom Pipes messages: a finished shard (``ray_shard``) charged to the budget guard, the
        planned share (``ray_plan``) checked against its estimate; any other message with a ``kind`` (e.g. progress)
        an asset observation."""
        msgs = session.get_custom_messages()
        for msg in msgs[seen:]:
            kind = msg.get("kind") if isinstance(msg, dict) else None
            if kind == "ray_shard":
                cls._check_budget(context, w, budget, charge=lambda m=msg: charge_shard(budget, m))
                if on_shard is not None:
                    on_shard(msg)
            elif kind == "ray_plan":
                if budget is not None and hasattr(budget, "check_planned"):
                    cls._check_budget(context, w, budget, charge=lambda m=msg: budget.check_planned(float(m["share"])))
            elif kind and context.has_assets_def:
                md = {k: v for k, v in msg.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
                context.log_event(AssetObservation(asset_key=context.asset_key, metadata=md))
        return len(msgs)


class _RayJobWatch(WorkloadWatch):
    """A generation stage's RayJob as :class:`~resources.k8s.watch.WorkloadWatch` watches it: the submitter's log
    followed (the driver's Pipes messages); the submitter or the head failing fails the stage at once, a worker pod
    that dies is only reported (Ray retries its shards on the other workers, KubeRay replaces the pod)."""

    title = "RayJob"
    drain_warning = "the submitter's log was still streaming when the job finished; it may be cut"

    def __init__(self, launcher, context, core, reader, session, w: kr.RayWorkload, custom, budget=None, on_shard=None):
        super().__init__(launcher, context, core, reader, session, w.name, w.namespace)
        self.w, self.custom, self.budget, self.on_shard = w, custom, budget, on_shard
        self.created = False

    def create(self) -> None:
        w, cluster = self.w, self.w.spec.kubernetes
        self.custom.create_namespaced_custom_object(
            kr.RAYJOB_GROUP, kr.RAYJOB_VERSION, cluster.namespace, kr.RAYJOB_PLURAL, kr.ray_job(w)
        )
        self.created = True
        ex, k = w.spec.execution, w.spec.execution.kuberay
        where = (
            f"on RayCluster {k.ray_cluster}"
            if k.ray_cluster
            else f"on a new Ray cluster: {ex.replicas} worker pod(s) x {ex.gpus_per_worker_pod} GPU(s)"
        )
        self.context.log.info(f"created RayJob/{w.name} in namespace {cluster.namespace} {where}, image {w.image}")

    def delete(self, why: str) -> None:
        if self.created:
            KubeRayJobLauncher._delete(self.context, self.custom, self.w, why=why)

    def read(self):
        w = self.w
        obj = self.custom.get_namespaced_custom_object(
            kr.RAYJOB_GROUP, kr.RAYJOB_VERSION, w.namespace, kr.RAYJOB_PLURAL, w.name
        )
        # the submitter's pods, then the job's Ray pods: head and workers (none with a long-lived cluster)
        submitters = list_pods(self.core, w.namespace, {kr.JOB_NAME_LABEL: w.name})
        ray_pods = (
            [] if w.spec.execution.kuberay.ray_cluster else list_pods(self.core, w.namespace, kr.selector_labels(w))
        )
        return obj, [(p, self._role(p, submitters)) for p in submitters + ray_pods]

    @staticmethod
    def _role(pod: dict[str, Any], submitters: list[dict[str, Any]]) -> str:
        if any(pod_name(pod) == pod_name(s) for s in submitters):
            return "submitter"
        node_type = ((pod.get("metadata") or {}).get("labels") or {}).get("ray.io/node-type")
        return "head" if node_type == "head" else "worker"

    def state(self, obj):
        return kr.rayjob_state(obj)

    def stream(self, seen: int) -> int:
        return KubeRayJobLauncher._stream_custom(self.context, self.w, self.session, seen, self.budget, self.on_shard)

    def check_budget(self) -> None:
        KubeRayJobLauncher._check_budget(self.context, self.w, self.budget)

    def followed(self, role):
        return role == "submitter"

    def who(self, role):
        return f"Ray {role} "

    def kind(self, obj):
        return "RayJob"

    def label(self):
        return f"RayJob/{self.w.name}"

    def tolerated(self, pod, problem, role):
        if problem.fatal and role == "worker" and (problem.exit_code is not None or pod_finished(pod)):
            return f"Ray worker {problem.describe()}; its shards are retried on the other workers"
        return None

    def failed(self, obj, pods, why):
        submitters = [p for p, role in pods if role == "submitter"]
        tail = (
            "\n".join(self.reader.tail(pod_name(submitters[0]))[-self.launcher.log_tail_lines :]) if submitters else ""
        )
        return Failure(
            f"RayJob {self.w.name} failed: {why}" + (f"\nlast log lines of the submitter:\n{tail}" if tail else ""),
            metadata={**self.ids(), "last_lines": MetadataValue.md(f"```\n{tail or '(no log lines)'}\n```")},
        )

    def ids(self):
        return {"ray_job": self.w.name, "namespace": self.w.namespace}

    def container(self, role):
        return {"submitter": kr.SUBMITTER_CONTAINER, "head": kr.HEAD_CONTAINER}.get(role, kr.WORKER_CONTAINER)

    def failure_words(self, problem: PodProblem, role):
        return f"Ray {role}", f"stopped RayJob {self.w.name}", {"role": role}
