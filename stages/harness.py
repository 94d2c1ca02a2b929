"""``lm_eval`` suites in the evaluation and distillation_set stages (shared helper, no stage of its own).

- :func:`harness_suites`: each ``kind: lm_eval`` suite with a content-addressed local copy of its
  ``include_path`` (``<artifact root>/_lm_eval_tasks/<sha256>``; ``s3://`` prefixes are downloaded;
  none without one: the harness's registry tasks), and where the worker caches its index of the
  harness's task registry (``<artifact root>/_lm_eval_tasks/_registry``).
- :func:`harness_models`: base and candidate as the harness process loads them (the evaluation's
  quantization and compute dtype, the adapter on top).
- :func:`gate_documents`: every gate suite's documents for the decontamination check: the held-out
  split or a suite's JSONL prompts, and each harness task's documents (read through the harness's
  preflight, no model).

The heavy work is in :mod:`evaluation.harness` (which starts :mod:`evaluation.harness_worker`).
"""

from __future__ import annotations

from pathlib import Path

from campaigns.spec import CampaignSpec, SuiteSpec
from stages.storage import Store

TASKS_DIR = "_lm_eval_tasks"


def is_harness(x: SuiteSpec) -> bool:
    return x.kind == "lm_eval"


def harness_suites(spec: CampaignSpec, storage: Store) -> list:
    from evaluation.harness import HarnessSuite, registry_sha256, task_dir

    out = []
    root = storage.root_path() / TASKS_DIR
    for x in spec.evaluation.suites:
        if is_harness(x):
            if x.lm_eval.include_path:
                d, sha = task_dir(x.lm_eval.include_path, spec.project_dir, root)
            else:
                d, sha = None, registry_sha256()
            out.append(
                HarnessSuite(x.name, x.lm_eval.model_dump(), d, sha, x.batch_size, registry_cache=root / "_registry")
            )
    return out


def harness_identity(x: SuiteSpec, suites: list) -> dict:
    """What changes an lm_eval suite's answers: its settings and the content of its task directory."""
    ident = x.model_dump(exclude={"gate", "tier"})
    ident["tasks_sha256"] = next(s.tasks_sha256 for s in suites if s.name == x.name)
    return ident


def harness_models(spec: CampaignSpec, adapter: dict, base: Path) -> list:
    from evaluation.harness import HarnessModel

    q = spec.student.quantization
    common = {"path": str(base), "load_in_4bit": q.load_in_4bit, "compute_dtype": q.compute_dtype}
    return [HarnessModel("base", **common), HarnessModel("candidate", adapter=adapter["adapter_path"], **common)]


def gate_documents(spec: CampaignSpec, heldout_rows: list[dict], storage: Store, workdir: Path, log=print) -> list:
    """Every gate suite's documents as ``campaign_orchestrator.dataset.decontamination.SuiteDocs``
    (a harness suite: one entry per task, named ``<suite>/<task>``)."""
    from campaign_orchestrator.dataset.decontamination import SuiteDocs
    from evaluation.harness import documents
    from evaluation.suite import load_items

    out, seen = [], set()
    for x in spec.evaluation.suites:
        if is_harness(x):
            continue
        key = x.source
        if key in seen:  # suites over the same items (another scorer) have the same documents
            continue
        seen.add(key)
        items = load_items(x.source, heldout_rows, spec.project_dir)
        out.append(SuiteDocs(x.name, [(it["id"], it["prompt"]) for it in items]))
    suites = harness_suites(spec, storage)
    for name, tasks in documents(suites, workdir, log).items():
        for task, docs in tasks.items():
            out.append(SuiteDocs(f"{name}/{task}", [(str(d["doc_id"]), d["text"]) for d in docs]))
    return out


def gate_documents_identity(spec: CampaignSpec, storage: Store, heldout_sha256: str) -> list:
    """What the gate documents depend on (for the distillation set's content key)."""
    from campaign_orchestrator.content import file_sha256

    suites = {s.name: s for s in harness_suites(spec, storage)}
    ident = []
    for x in spec.evaluation.suites:
        if is_harness(x):
            ident.append({"suite": x.name, "lm_eval": x.lm_eval.model_dump(), "tasks": suites[x.name].tasks_sha256})
        elif x.source == "heldout":
            ident.append({"suite": x.name, "heldout": heldout_sha256})
        else:
            p = spec.path(x.source)
            ident.append({"suite": x.name, "source": x.source, "sha256": file_sha256(p) if p.exists() else None})
    return ident
