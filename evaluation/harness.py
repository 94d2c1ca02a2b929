"""``lm_eval`` suites: tasks of EleutherAI's lm-evaluation-harness, judged by this project's gate.

The harness brings the task definitions teams publish (YAML: prompts, few-shot, filters, metrics);
this project brings the paired statistics. For each ``lm_eval`` suite the base and the candidate
(base + adapter) run through one harness call with identical settings (batch size, dtype, chat
template, few-shot, generation settings, seeds) and ``log_samples``; the per-document rows of the
two runs are joined on (task, doc_id) with the document hash checked, a prompt-hash mismatch is an
error (never a silent join), and the gated metric of each document becomes an item result for
:func:`evaluation.gate.decide`: paired intervals, McNemar, per-category rules (a group's subtasks or
a document field), tiers. The harness's own aggregate is shown beside the project's mean of the same
rows, and they must agree for each model and task.

The harness runs in its own process (:mod:`evaluation.harness_worker`), offline by default
(``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``), in a content-addressed copy of the suite's
``include_path`` (local or ``s3://``), so a changed task file is a new copy and never a stale
datasets cache. Task names not defined there (or every name, without an ``include_path``) come from
the harness's own task registry (``arc_easy``, ``hellaswag``, ...; their datasets from the local
Hugging Face datasets cache when offline). Its preflight refuses, before any model runs, task files
that do not load, unknown tasks, missing data (a hub dataset the offline cache lacks: with how to
fetch it), metrics that would come from the hub and base/candidate prompt mismatches.

This module imports neither torch nor ``lm_eval``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from campaigns import paths
from campaigns.object_store import is_s3_url
from evaluation.gate import ItemResult

HARNESS = "lm_eval==0.4.13"
EVENT = "@@harness "
AGREEMENT_TOLERANCE = 1e-9


class HarnessError(RuntimeError):
    """The harness refused a suite or failed; the message names the suite, task or file and what was expected."""

    def __init__(self, message: str, problems: list[str] | None = None, models_loaded: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]
        self.models_loaded = models_loaded or []


@dataclass(frozen=True)
class HarnessModel:
    """A model as the worker loads it (the project's loader: same quantization and dtype as the evaluation)."""

    role: str
    path: str
    adapter: str | None = None
    load_in_4bit: bool = False
    compute_dtype: str = "bfloat16"
    device: str | None = None


@dataclass(frozen=True)
class HarnessSuite:
    name: str
    settings: dict  # campaigns.spec.LmEvalSpec, dumped
    task_dir: Path | None  # the local, content-addressed copy of include_path (None: the registry's tasks only)
    tasks_sha256: str  # tree_sha256(task_dir), or registry_sha256() without one
    batch_size: int = 16
    registry_cache: Path | None = None  # where the worker keeps its index of the harness's task registry


def registry_sha256() -> str:
    """What the registry's task files are (a suite without ``include_path``): the installed lm_eval version."""
    from importlib.metadata import version

    return hashlib.sha256(f"lm_eval=={version('lm_eval')} task registry".encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- task files


def tree_sha256(root: Path) -> str:
    """Content hash of a directory: every file's relative path and bytes (``__pycache__`` left out)."""
    h = hashlib.sha256()
    for p in sorted(x for x in Path(root).rglob("*") if x.is_file() and "__pycache__" not in x.parts):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _fetch_s3_tree(uri: str, dest: Path, client=None) -> Path:
    from campaigns.object_store import parse_s3_url, s3_client

    try:
        url = parse_s3_url(uri, "lm_eval.include_path")
    except ValueError as e:
        raise HarnessError(str(e)) from None
    bucket, prefix = url.bucket, url.key + "/" if url.key else ""
    client = client or s3_client()
    keys = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", []) if not o["Key"].endswith("/")]
    except Exception as e:  # botocore ClientError / EndpointConnectionError / NoCredentialsError
        raise HarnessError(
            f"lm_eval.include_path {uri}: cannot list s3://{bucket}/{prefix}: {type(e).__name__}: {e}"
        ) from None
    if not keys:
        raise HarnessError(f"lm_eval.include_path {uri}: no objects under s3://{bucket}/{prefix}")
    for k in keys:
        out = dest / k[len(prefix) :]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(client.get_object(Bucket=bucket, Key=k)["Body"].read())
    return dest


def task_dir(include_path: str, project_dir: Path, cache_root: Path, client=None) -> tuple[Path, str]:
    """A local, content-addressed copy of a suite's ``include_path`` and its content hash:
    ``cache_root/<sha256>/``. An unchanged directory is copied once; an edited one gets a new copy."""
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root, prefix=".incoming-") as tmp:
        staged = Path(tmp) / "tasks"
        if is_s3_url(include_path):
            _fetch_s3_tree(include_path, staged, client)
        else:
            src = paths.resolve(include_path, project_dir)
            if not src.is_dir():
                raise HarnessError(
                    f"lm_eval.include_path {include_path!r}: {src} is not a directory of task YAML files"
                )
            shutil.copytree(src, staged, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        sha = tree_sha256(staged)
        final = cache_root / sha
        if not final.exists():
            try:
                os.replace(staged, final)
            except OSError:  # another process put the same content there first
                if not final.exists():
                    raise
    return final, sha


# ---------------------------------------------------------------------------------------------- the worker


def _job(mode: str, suites: list[HarnessSuite], models: list[HarnessModel], threads: int | None) -> dict:
    return {
        "mode": mode,
        "threads": threads,
        "batch_size": max((s.batch_size for s in suites), default=16),
        "registry_cache": next((str(s.registry_cache) for s in suites if s.registry_cache), None),
        "suites": [{**s.settings, "name": s.name, "dir": str(s.task_dir) if s.task_dir else None} for s in suites],
        "models": [asdict(m) for m in models],
    }


def worker_env(offline: bool = True) -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    if offline:
        env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return env


def run_worker(
    job: dict,
    workdir: Path,
    log: Callable[[str], None] = print,
    on_event: Callable[[dict], None] | None = None,
    timeout_s: float | None = None,
) -> dict:
    """Run the harness process on ``job``; its result, or :class:`HarnessError` (refusal or crash).
    ``on_event`` sees each progress event; if it raises, the process is stopped and the error re-raised."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, out_path, log_path = workdir / "harness_job.json", workdir / "harness_out.json", workdir / "harness.log"
    job_path.write_text(json.dumps(job, indent=1))
    out_path.unlink(missing_ok=True)
    offline = all(s.get("offline", True) for s in job["suites"])
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with open(log_path, "w", encoding="utf-8") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "evaluation.harness_worker", str(job_path), str(out_path)],
            cwd=paths.project_dir(),
            env=worker_env(offline),
            stdout=subprocess.PIPE,
            stderr=logf,
            text=True,
            start_new_session=True,
        )
        try:
            for line in proc.stdout:
                if line.startswith(EVENT):
                    ev = json.loads(line[len(EVENT) :])
                    log(f"lm_eval: {_describe(ev)}")
                    if on_event is not None:
                        on_event(ev)
                else:
                    logf.write(line)
                if deadline is not None and time.monotonic() > deadline:
                    raise HarnessError(f"the harness process ran past {timeout_s:.0f} s (log: {log_path})")
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if not out_path.exists():
        tail = log_path.read_text(errors="replace")[-2000:]
        raise HarnessError(f"the harness process exited {rc} without a result (log {log_path}):\n{tail}")
    out = json.loads(out_path.read_text())
    if out["status"] == "refused":
        raise HarnessError(
            "lm_eval suite refused before any model ran:\n- " + "\n- ".join(out["problems"]),
            out["problems"],
            out.get("models_loaded"),
        )
    if out["status"] != "ok":
        raise HarnessError(
            f"the harness failed ({out.get('error_type')}: {out.get('error')}); log {log_path}\n"
            f"{out.get('traceback', '')[-3000:]}",
            models_loaded=out.get("models_loaded"),
        )
    return out


def _describe(ev: dict) -> str:
    if ev["event"] == "preflight":
        return f"preflight passed in {ev['seconds']:.1f} s"
    if ev["event"] == "model_loaded":
        return f"{ev['role']} loaded in {ev['seconds']:.1f} s"
    if ev["event"] == "suite_done":
        return f"{ev['role']} on {ev['suite']}: {ev['docs']} documents in {ev['seconds']:.1f} s"
    return json.dumps(ev)


def documents(
    suites: list[HarnessSuite], workdir: Path, log: Callable[[str], None] = print, threads: int | None = 1
) -> dict[str, dict[str, list[dict]]]:
    """suite -> task -> documents ({doc_id, doc_hash, text, category}), through the harness's preflight
    (no model). ``text`` is the document's decontamination query (its rendered ``doc_to_text``)."""
    if not suites:
        return {}
    out = run_worker(_job("docs", suites, [], threads), workdir, log)
    return {name: s["docs"] for name, s in out["suites"].items()}


# ---------------------------------------------------------------------------------------------- join and check


@dataclass
class TaskAgreement:
    """One model on one task: the harness's aggregate beside the project's mean of the same rows."""

    suite: str
    task: str
    role: str
    metric: str
    documents: int
    harness: float | None
    project: float | None

    @property
    def agrees(self) -> bool:
        if self.harness is None or self.project is None:
            return self.harness is None and self.project is None
        return math.isclose(self.harness, self.project, rel_tol=0.0, abs_tol=AGREEMENT_TOLERANCE)


@dataclass
class HarnessRun:
    """What the harness gave for every suite: item rows for the gate and the agreement table."""

    rows: list[dict]
    agreement: list[TaskAgreement]
    tasks: dict[str, dict]  # suite -> task -> {metric, filter, output_type, documents, ...}
    seconds: dict[str, float]  # role -> seconds the harness spent on it (load + every suite)
    wall_seconds: float
    lm_eval_version: str | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "harness": HARNESS,
            "lm_eval_version": self.lm_eval_version,
            "tasks": self.tasks,
            "seconds": self.seconds,
            "wall_seconds": self.wall_seconds,
            "agreement": [asdict(a) | {"agrees": a.agrees} for a in self.agreement],
        }


def join_suite(name: str, entry: dict, roles: list[str]) -> tuple[dict[str, list[ItemResult]], list[TaskAgreement]]:
    """Item results per role, joined on (task, doc_id) across roles: every role has every document, the
    document hashes agree, and each run's prompts are those the preflight rendered for that role and
    equal across roles. Raises :class:`HarnessError` naming the task and documents otherwise."""
    runs = entry["runs"]
    out: dict[str, list[ItemResult]] = {r: [] for r in roles}
    agreement = []
    problems = []
    for task, meta in entry["tasks"].items():
        docs = {str(d["doc_id"]): d for d in entry["docs"][task]}
        by_role = {}
        for r in roles:
            rows = {str(s["doc_id"]): s for s in runs[r]["samples"].get(task, [])}
            missing, extra = sorted(set(docs) - set(rows)), sorted(set(rows) - set(docs))
            if missing or extra:
                problems.append(
                    f"suite {name}: task {task!r}: the {r} run has {len(rows)} documents, the task "
                    f"{len(docs)} (missing {missing[:3]}, unexpected {extra[:3]})"
                )
                continue
            bad_doc = [d for d in docs if rows[d]["doc_hash"] != docs[d]["doc_hash"]]
            if bad_doc:
                problems.append(
                    f"suite {name}: task {task!r}: the {r} run scored different documents than the task "
                    f"holds (doc hash mismatch for {len(bad_doc)}, e.g. doc_id {bad_doc[0]})"
                )
            want = (entry.get("prompts") or {}).get(r, {}).get(task)
            if want is not None:
                bad = [d for d in docs if rows[d]["prompt_hash"] != want.get(d)]
                if bad:
                    problems.append(
                        f"suite {name}: task {task!r}: the {r} was asked prompts other than the preflight "
                        f"rendered for {len(bad)} documents (e.g. doc_id {bad[0]})"
                    )
            by_role[r] = rows
        if len(by_role) == len(roles) and len(roles) > 1:
            ref = roles[0]
            for r in roles[1:]:
                bad = [d for d in docs if by_role[r][d]["prompt_hash"] != by_role[ref][d]["prompt_hash"]]
                if bad:
                    problems.append(
                        f"suite {name}: task {task!r}: prompt hash mismatch between {ref} and {r} for "
                        f"{len(bad)} of {len(docs)} documents (e.g. doc_id {bad[0]}): the models were not "
                        "asked the same questions, so their scores cannot be paired"
                    )
        for r, rows in by_role.items():
            for d, doc in docs.items():
                s = rows[d]
                out[r].append(
                    ItemResult(
                        item_id=f"{task}/{d}",
                        category=doc["category"],
                        output=s["output"] or "",
                        score=s["score"],
                        latency_s=0.0,
                        error=None,
                        prompt=s["prompt"],
                        reference=s["reference"],
                    )
                )
            scores = [rows[d]["score"] for d in docs if rows[d]["score"] is not None]
            agreement.append(
                TaskAgreement(
                    name,
                    task,
                    r,
                    meta["metric"],
                    len(docs),
                    runs[r]["aggregates"].get(task),
                    sum(scores) / len(scores) if scores else None,
                )
            )
    if problems:
        raise HarnessError("lm_eval results cannot be paired:\n- " + "\n- ".join(problems), problems)
    off = [a for a in agreement if not a.agrees]
    if off:
        raise HarnessError(
            "the harness's aggregate and the mean of its per-document scores disagree: "
            + "; ".join(
                f"{a.suite}/{a.task} {a.role}: harness {a.harness} vs {a.project} over {a.documents} documents"
                for a in off
            )
        )
    return out, agreement


def evaluate_suites(
    suites: list[HarnessSuite],
    models: list[HarnessModel],
    workdir: Path,
    log: Callable[[str], None] = print,
    progress: Callable[[int], None] | None = None,
    threads: int | None = 1,
) -> HarnessRun:
    """Every model on every ``lm_eval`` suite through one harness process; the joined, checked item
    rows (items.parquet schema) and the agreement table. ``progress(docs)`` after each model's suite
    (a budget watch may raise there: the process is stopped). ``threads``: torch threads in the
    harness process (1 by default: small-batch CPU inference is bound by per-op overhead, where more
    threads on a shared machine only contend, as the local training launcher finds; None: torch's
    default)."""
    t0 = time.perf_counter()
    seconds: dict[str, float] = defaultdict(float)

    def on_event(ev: dict) -> None:
        if ev["event"] in ("model_loaded", "suite_done"):
            seconds[ev["role"]] += float(ev["seconds"])
        if ev["event"] == "suite_done" and progress is not None:
            progress(int(ev["docs"]))

    out = run_worker(_job("evaluate", suites, models, threads), workdir, log, on_event)
    roles = [m.role for m in models]
    rows, agreement, tasks = [], [], {}
    for s in suites:
        entry = out["suites"][s.name]
        results, agree = join_suite(s.name, entry, roles)
        agreement += agree
        tasks[s.name] = entry["tasks"]
        for role in roles:
            per_doc = entry["runs"][role]["seconds"] / max(1, len(results[role]))  # the run's time, shared out
            for it in results[role]:
                rows.append(
                    {
                        "suite": s.name,
                        "model": role,
                        "item_id": it.item_id,
                        "category": it.category,
                        "prompt": it.prompt,
                        "reference": it.reference,
                        "output": it.output,
                        "score": it.score,
                        "latency_s": per_doc,
                        "error": None,
                    }
                )
    return HarnessRun(rows, agreement, tasks, dict(seconds), time.perf_counter() - t0, out.get("lm_eval_version"))


def agreement_markdown(doc: dict) -> str:
    """The harness's aggregates beside the project's means (for the gate report)."""
    lines = [
        f"### lm-evaluation-harness suites ({doc.get('harness', HARNESS)})",
        "",
        "Per task and model: the harness's own aggregate and the mean of its per-document scores that the gate "
        "judged (they must agree).",
        "",
        "| suite | task | model | metric | documents | harness | project mean | agrees |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for a in doc["agreement"]:
        h = "—" if a["harness"] is None else f"{a['harness']:.4f}"
        p = "—" if a["project"] is None else f"{a['project']:.4f}"
        lines.append(
            f"| {a['suite']} | {a['task']} | {a['role']} | {a['metric']} | {a['documents']} | {h} | {p} | "
            f"{'yes' if a['agrees'] else '**no**'} |"
        )
    secs = ", ".join(f"{r} {s:.1f} s" for r, s in doc.get("seconds", {}).items())
    lines += ["", f"Harness time: {doc.get('wall_seconds', 0.0):.1f} s in all ({secs})."]
    return "\n".join(lines)
