"""Launch ``python -m training`` as a multi-node Kubernetes workload and follow it from Dagster.

Lifecycle of one launch (``K8sTrainingLauncher.launch``):

1. Check that every path the trainer needs lies on a volume the pods mount, write the TrainJob
   file there, and open a Pipes session (context in the pods' environment, messages from logs).
2. Create the headless Service and the Indexed Job (or the PyTorchJob), labelled with the
   campaign, the Dagster run id and the asset key.
3. Poll the workload and its pods: follow each pod's log as soon as it starts (Pipes messages
   stream into the asset: logs at once, training metrics as ``AssetObservation`` events); on the
   first pod that fails (OOMKilled, non-zero exit, eviction, a missing Secret, an image that
   cannot be pulled) fail the asset with the pod's name, reason and last log lines at once,
   without waiting for the other ranks to hit their NCCL timeout.
   Each poll also checks the campaign's budget guard against the spend so far (GPU-hours since
   the launch x price): when it would be exceeded the launch stops like a cancelled one (the
   trainer gets SIGTERM and writes a checkpoint, so materializing again resumes) and the guard's
   budget-stop failure, with what was spent and what remains, fails the asset.
4. Delete the Job and the Service when the asset succeeds, fails, is stopped by its budget or the
   Dagster run is cancelled (``ttlSecondsAfterFinished`` is only the backstop).

Steps 3 and 4 are the watch both Kubernetes launchers share (``watch.py``: :class:`~resources.k8s.watch.
WorkloadWatch`), in this launcher's words (``_JobWatch``).

When the process running the launch dies without cleaning up (SIGKILL, OOM), the run's owner
record (``campaign/owner``: ``k8s``) names the cluster and namespace, and the stale-run reaper
(``assets/run_recovery.py``) deletes the dead run's workloads by their ``dagster/run-id`` label
(:func:`delete_run_workloads`) before it frees the run's pool slot.

The Kubernetes client is imported inside the methods: a code location that never launches on
Kubernetes never imports it.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from dagster import AssetObservation, Failure, MetadataValue
from pydantic import Field

from campaigns.spec import KubernetesSpec
from resources.k8s import manifests as mf
from resources.k8s.connection import KubernetesLauncher
from resources.k8s.status import PodProblem, pod_node_index, workload_state
from resources.k8s.watch import WorkloadWatch, list_pods, pipes_session
from stages.pricing import charge_round


def delete_run_workloads(where: dict[str, Any], run_id: str) -> list[str]:
    """Delete every Job, PyTorchJob, RayJob and Service labelled with ``run_id`` in ``where["namespace"]`` of the
    cluster ``where`` names (the owner record's ``k8s``: namespace, kubeconfig_file, kube_context, in_cluster); the pods
    go with their Job (a RayJob's cluster and submitter with it). Returns ``Kind/name`` of what was deleted; raises when
    the API cannot be reached."""
    from kubernetes import client
    from kubernetes.client import ApiException

    launcher = K8sTrainingLauncher(
        kubeconfig_file=where.get("kubeconfig_file"),
        kube_context=where.get("kube_context"),
        in_cluster=where.get("in_cluster"),
    )
    api = launcher.api_client()
    core, batch, custom = client.CoreV1Api(api), client.BatchV1Api(api), client.CustomObjectsApi(api)
    ns, label = where["namespace"], mf.label_value(run_id)
    selector = f"{mf.RUN_ID_LABEL}={label}"

    def mine(meta: dict) -> bool:  # the selector again, client-side: never delete another run's workload
        return (meta.get("labels") or {}).get(mf.RUN_ID_LABEL) == label

    deleted = []
    jobs = json.loads(batch.list_namespaced_job(ns, label_selector=selector, _preload_content=False).data)
    for j in jobs.get("items", []):
        if mine(j["metadata"]):
            batch.delete_namespaced_job(j["metadata"]["name"], ns, propagation_policy="Background")
            deleted.append(f"Job/{j['metadata']['name']}")
    try:
        pts = custom.list_namespaced_custom_object(
            mf.PYTORCHJOB_GROUP, mf.PYTORCHJOB_VERSION, ns, mf.PYTORCHJOB_PLURAL, label_selector=selector
        )
    except ApiException as e:
        if e.status != 404:  # 404: no training operator in this cluster
            raise
        pts = {}
    for j in pts.get("items", []):
        if mine(j["metadata"]):
            custom.delete_namespaced_custom_object(
                mf.PYTORCHJOB_GROUP,
                mf.PYTORCHJOB_VERSION,
                ns,
                mf.PYTORCHJOB_PLURAL,
                j["metadata"]["name"],
                propagation_policy="Background",
            )
            deleted.append(f"PyTorchJob/{j['metadata']['name']}")
    deleted += _delete_run_rayjobs(custom, ns, selector, mine)
    svcs = json.loads(core.list_namespaced_service(ns, label_selector=selector, _preload_content=False).data)
    for sv in svcs.get("items", []):
        if mine(sv["metadata"]):
            core.delete_namespaced_service(sv["metadata"]["name"], ns)
            deleted.append(f"Service/{sv['metadata']['name']}")
    return deleted


def _delete_run_rayjobs(custom, ns: str, selector: str, mine) -> list[str]:
    """The run's KubeRay RayJobs (generation stages, ``kuberay_launcher.py``); KubeRay's owner references take their
    Ray clusters and submitter Jobs with them. None where the cluster has no KubeRay (404)."""
    from kubernetes.client import ApiException

    from resources.k8s.kuberay import RAYJOB_GROUP, RAYJOB_PLURAL, RAYJOB_VERSION

    try:
        jobs = custom.list_namespaced_custom_object(
            RAYJOB_GROUP, RAYJOB_VERSION, ns, RAYJOB_PLURAL, label_selector=selector
        )
    except ApiException as e:
        if e.status != 404:
            raise
        return []
    deleted = []
    for j in jobs.get("items", []):
        if mine(j["metadata"]):
            custom.delete_namespaced_custom_object(
                RAYJOB_GROUP, RAYJOB_VERSION, ns, RAYJOB_PLURAL, j["metadata"]["name"], propagation_policy="Background"
            )
            deleted.append(f"RayJob/{j['metadata']['name']}")
    return deleted


class K8sTrainingLauncher(KubernetesLauncher):
    """Runs training as an Indexed Job + headless Service (or a Kubeflow PyTorchJob) on Kubernetes."""

    poll_interval_s: float = Field(2.0, gt=0, description="Seconds between two looks at the job and its pods.")
    image_pull_timeout_s: float = Field(300, gt=0, description="Fail when an image cannot be pulled for this long.")
    delete_on_success: bool = Field(True, description="Delete Job and Service when training succeeds.")
    echo_logs: bool = Field(True, description="Copy pod log lines to the step's stdout (captured by Dagster).")
    owned_by_run_pod: bool = Field(
        True,
        description="When the Dagster run pod is in the training namespace, make it"
        " the owner of the Job and Service, so Kubernetes deletes them"
        " if the run pod dies without cleaning up.",
    )

    # ------------------------------------------------------------------ launch
    def launch(self, context, job, workdir: Path, kubernetes: KubernetesSpec, budget=None) -> dict:
        """Run ``job`` (a ``training.config.TrainJob``) on the cluster; return its node logs and Pipes metadata.

        ``budget``: a ``campaign_orchestrator.costs.budget.BudgetGuard`` checked at every poll while the workload runs;
        when it
        stops the stage, the Job and Service are deleted (every pod gets SIGTERM: the trainer checkpoints)
        and its failure is raised, as the local launcher does."""
        cluster = kubernetes
        workdir = Path(workdir)
        env_problem = mf.env_conflicts(job.training, cluster)
        if env_problem:
            raise Failure(f"campaign {job.campaign}: {env_problem}")
        job_file = Path(workdir) / "train_job.json"
        bad = mf.unreachable_paths(
            {
                "base_model_path": job.base_model_path,
                "dataset_path": job.dataset_path,
                "output_dir": job.output_dir,
                "train_job_file": str(job_file),
            },
            cluster,
        )
        if bad:
            raise Failure(
                f"the training pods cannot see {', '.join(bad)}: they mount only {mf.mount_roots(cluster)}. Put the "
                f"artifact root on the shared volume (kubernetes.artifacts, mounted at the same path in the Dagster "
                f"run pod) or mount the model's volume under kubernetes.volumes"
            )
        workdir.mkdir(parents=True, exist_ok=True)
        job.write(job_file)

        from kubernetes import client

        api = self.api_client()
        core, batch, custom = client.CoreV1Api(api), client.BatchV1Api(api), client.CustomObjectsApi(api)
        self._record_cluster(context, cluster.namespace)
        name = mf.workload_name(job.campaign, context.run_id, secrets.token_hex(3))
        asset_key = context.asset_key.to_user_string() if context.has_assets_def else ""
        container = mf.PYTORCHJOB_CONTAINER if cluster.workload == "pytorchjob" else mf.CONTAINER
        extras = {"campaign": job.campaign, "workload": name}
        with pipes_session(self, context, core, cluster.namespace, workdir, container, extras) as (session, reader):
            w = mf.Workload(
                campaign=job.campaign,
                training=job.training,
                cluster=cluster,
                job_file=str(job_file),
                name=name,
                run_id=context.run_id,
                asset_key=asset_key,
                pipes_env=dict(session.get_bootstrap_env_vars()),
                owner=self.run_pod_owner(core, cluster.namespace),
            )
            pipes_md = _JobWatch(self, context, core, reader, session, w, batch, custom, budget).launch()
        summary_file = Path(job.output_dir) / "summary.json"
        logs = [str(p) for p in reader.log_files()]
        if not summary_file.exists():
            raise Failure(
                f"training job {name} succeeded but wrote no {summary_file}",
                metadata={"logs": MetadataValue.json(logs)},
            )
        return {"logs": logs, "pipes_metadata": pipes_md, "k8s_workload": name, "k8s_namespace": cluster.namespace}

    # ------------------------------------------------------------------ create / delete
    @staticmethod
    def _create(core, batch, custom, m: dict[str, Any]) -> None:
        ns = m["metadata"]["namespace"]
        if m["kind"] == "Service":
            core.create_namespaced_service(ns, m)
        elif m["kind"] == "Job":
            batch.create_namespaced_job(ns, m)
        else:
            custom.create_namespaced_custom_object(
                mf.PYTORCHJOB_GROUP, mf.PYTORCHJOB_VERSION, ns, mf.PYTORCHJOB_PLURAL, m
            )

    @staticmethod
    def _delete(context, core, batch, custom, w: mf.Workload, created: list[dict[str, Any]], why: str) -> None:
        from kubernetes.client import ApiException

        deleted = []
        for m in reversed(created):
            ns, kind = m["metadata"]["namespace"], m["kind"]
            try:
                if kind == "Job":
                    batch.delete_namespaced_job(w.name, ns, propagation_policy="Background")
                elif kind == "Service":
                    core.delete_namespaced_service(w.name, ns)
                else:
                    custom.delete_namespaced_custom_object(
                        mf.PYTORCHJOB_GROUP,
                        mf.PYTORCHJOB_VERSION,
                        ns,
                        mf.PYTORCHJOB_PLURAL,
                        w.name,
                        propagation_policy="Background",
                    )
                deleted.append(f"{kind}/{w.name}")
            except ApiException as e:
                if e.status != 404:
                    context.log.warning(
                        f"could not delete {kind}/{w.name} ({e.status} {e.reason}); "
                        f"ttlSecondsAfterFinished will remove it"
                    )
            except Exception as e:  # never hide the original error behind a cleanup error
                context.log.warning(f"could not delete {kind}/{w.name}: {e}")
        if deleted:
            context.log.info(f"deleted {', '.join(deleted)} ({why})")

    @staticmethod
    def _check_budget(context, w: mf.Workload, budget) -> None:
        """Let the guard see the time spent so far; its budget stop propagates to ``launch``, which deletes
        the Job and Service (every pod gets SIGTERM and its grace period: the trainer writes a checkpoint)."""
        if budget is None:
            return
        try:
            budget.check()
        except Exception:  # the budget stop (a Dagster Failure); an interrupt is not the budget's
            context.log.warning(
                f"budget: stopping {w.name} ({w.nodes} node(s) x {w.gpus} process(es)); its pods get SIGTERM and "
                f"{w.cluster.termination_grace_period_seconds}s to write a checkpoint the next launch resumes from"
            )
            raise

    @staticmethod
    def _stream_metrics(context, session, seen: int, budget=None) -> int:
        """New ``train_metrics`` messages as asset observations; a finished on-policy round (``on_policy_round``:
        an API teacher's prefills) charged to the budget guard, which stops the workload when it crosses."""
        msgs = session.get_custom_messages()
        for msg in msgs[seen:]:
            if isinstance(msg, dict) and msg.get("kind") == "on_policy_round" and budget is not None:
                charge_round(budget, msg)
            if isinstance(msg, dict) and msg.get("kind") == "train_metrics" and context.has_assets_def:
                md = {
                    k: v
                    for k, v in msg.items()
                    if k != "kind" and isinstance(v, (int, float)) and not isinstance(v, bool)
                }
                context.log_event(AssetObservation(asset_key=context.asset_key, metadata=md))
        return len(msgs)


class _JobWatch(WorkloadWatch):
    """A training launch's Job and Service (or PyTorchJob) as :class:`~resources.k8s.watch.WorkloadWatch` watches
    it: every pod's log followed (rank 0's carries the Pipes messages), filed by node; any pod that fails fails the
    launch, without waiting for the other ranks to hit their NCCL timeout."""

    title = "training job"
    drain_warning = "some pod logs were still streaming when the job finished; node logs may be cut"

    def __init__(self, launcher, context, core, reader, session, w: mf.Workload, batch, custom, budget=None):
        super().__init__(launcher, context, core, reader, session, w.name, w.namespace)
        self.w, self.batch, self.custom, self.budget = w, batch, custom, budget
        self.created: list[dict[str, Any]] = []

    def create(self) -> None:
        w, cluster = self.w, self.w.cluster
        for m in mf.build_manifests(w):
            K8sTrainingLauncher._create(self.core, self.batch, self.custom, m)
            self.created.append(m)
        self.context.log.info(
            f"created {', '.join(m['kind'] + '/' + w.name for m in self.created)} in namespace {cluster.namespace}: "
            f"{w.nodes} node(s) x {w.gpus} process(es), sharding {w.training.sharding}, image {cluster.image}"
        )

    def delete(self, why: str) -> None:
        K8sTrainingLauncher._delete(self.context, self.core, self.batch, self.custom, self.w, self.created, why=why)

    def read(self):
        w = self.w
        if w.cluster.workload == "pytorchjob":
            obj = self.custom.get_namespaced_custom_object(
                mf.PYTORCHJOB_GROUP, mf.PYTORCHJOB_VERSION, w.namespace, mf.PYTORCHJOB_PLURAL, w.name
            )
        else:
            obj = json.loads(self.batch.read_namespaced_job(w.name, w.namespace, _preload_content=False).data)
        return obj, [(p, None) for p in list_pods(self.core, w.namespace, mf.selector_labels(w))]

    def state(self, obj):
        return workload_state(obj)

    def stream(self, seen: int) -> int:
        return K8sTrainingLauncher._stream_metrics(self.context, self.session, seen, self.budget)

    def check_budget(self) -> None:
        K8sTrainingLauncher._check_budget(self.context, self.w, self.budget)

    def node(self, pod):
        return pod_node_index(pod)

    def failed(self, obj, pods, why):
        return Failure(
            f"{obj.get('kind', 'workload')} {self.w.name} failed: {why}; no failed pod was found to "
            f"blame (deadline, backoff limit or deleted pods)",
            metadata=self.ids(),
        )

    def ids(self):
        return {"k8s_workload": self.w.name, "namespace": self.w.namespace}

    def failure_words(self, problem: PodProblem, role=None):
        node = problem.node if problem.node is not None else -1
        return "training", f"stopped job {self.w.name} (all {self.w.nodes} node(s))", {"node": node}
