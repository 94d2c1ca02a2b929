"""The lm-evaluation-harness process: ``python -m evaluation.harness_worker JOB.json OUT.json``.

Started by :mod:`evaluation.harness` (never imported by the code location: it imports torch,
transformers and ``lm_eval``). One process answers every ``lm_eval`` suite of an evaluation, for
every model, so the harness's imports, its environment (offline variables) and its logging stay out
of the orchestrator's process.

Modes (``JOB["mode"]``):

- ``docs``: the preflight below, then each task's documents (id, hash, decontamination text); no model.
- ``evaluate``: the preflight, then per model: load it with the project's loader (the same 4-bit /
  dtype / adapter handling as the project's own evaluation), wrap it in the harness's ``HFLM`` and run
  ``lm_eval.simple_evaluate`` with ``log_samples`` on every suite with the suite's settings.

Task names resolve in the suite's ``include_path`` first, then in the harness's own task registry
(``lm_eval/tasks``: ``arc_easy``, ``hellaswag``, ``mmlu``, ...), which is indexed only when a name (or
a group's member) is not in the include_path. Indexing the registry reads ~15,000 YAML entries (about
5 s); the index is kept as a pickle in ``JOB["registry_cache"]`` keyed by the lm_eval version and
install (about 0.7 s to read) and built once per process.

The preflight runs before any model is loaded, and refuses (exit 2, ``status: refused``, every
problem in ``problems``): an include_path that is missing; a YAML file that does not load (the
harness's index skips those silently: a missing ``include:`` file, a syntax error); a task name no
YAML defines; a missing local data file; offline, a Hugging Face dataset that is not in the local
datasets cache (the message says how to fetch it on a connected machine); a metric that is neither built in nor a
``!function`` shipped
with the task (it would fall back to ``evaluate.load``, the hub), or one marked ``hf_evaluate``; an
unknown filter; a gated metric whose aggregation is not ``mean``; a ``category_field`` missing from a
document; and base and candidate prompts that differ (rendered with each model's tokenizer: a
different chat template shows up here, before anything runs).

Progress goes to stdout as lines ``@@harness {json}`` (``preflight``, ``model_loaded``, ``suite_done``);
the result is OUT (plain JSON, written to a temporary file and renamed). Exit 1: a crash, with the
error and traceback in OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

EVENT = "@@harness "
LOADED: list[str] = []  # roles whose model this process loaded (none when the preflight refuses)
_LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
_MANAGERS: dict = {}  # (include dir, with the registry) -> TaskManager, built once per process


class Refused(Exception):
    def __init__(self, problems: list[str], stage: str = "preflight"):
        super().__init__("; ".join(problems))
        self.problems, self.stage = problems, stage


def emit(event: str, **fields) -> None:
    print(EVENT + json.dumps({"event": event, **fields}), flush=True)


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def _dump(obj: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, default=_jsonable)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- preflight


def _registries():
    import lm_eval.api.metrics  # noqa: F401  (fills the metric and aggregation registries)
    import lm_eval.filters  # noqa: F401  (fills the filter registry)
    from lm_eval.api.registry import aggregation_registry, filter_registry, metric_registry

    return metric_registry, aggregation_registry, filter_registry


def _yaml_errors(root: Path) -> dict[str, str]:
    """Every YAML file under ``root`` that does not load (the harness's index skips them silently)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    out = {}
    for p in sorted(root.rglob("*.yaml")):
        try:
            load_yaml(p, resolve_func=True)
        except Exception as e:  # yaml.YAMLError, FileNotFoundError (include), AttributeError (!function)
            out[str(p.relative_to(root))] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return out


def _registry_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _registry_key(root: Path) -> str:
    import hashlib

    import lm_eval

    stamp = [
        getattr(lm_eval, "__version__", "?"),
        str(root),
        root.stat().st_mtime_ns,
        (root / "__init__.py").stat().st_mtime_ns if (root / "__init__.py").exists() else 0,
    ]
    return hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]


def registry_index(cache_dir: str | None, root: Path | None = None) -> dict:
    """The harness's own task registry (``lm_eval/tasks``, or ``root``) as lm_eval indexes it, from the
    pickle in ``cache_dir`` when one was written for this lm_eval install (else built, and written there)."""
    import pickle

    from lm_eval.tasks._index import Entry, Kind, TaskIndex

    root = Path(root) if root is not None else _registry_dir()
    path = Path(cache_dir) / f"registry-{_registry_key(root)}.pickle" if cache_dir else None
    if path is not None and path.is_file():
        try:
            return pickle.loads(path.read_bytes())
        except Exception:  # noqa: BLE001 - a torn or stale cache is rebuilt
            pass
    index = TaskIndex.build([root])
    if path is not None:
        # a task's YAML is re-read from yaml_path when it is built, so only groups keep their config
        slim = {
            k: Entry(
                e.name, e.kind, e.yaml_path, e.cfg if e.kind == Kind.GROUP or e.yaml_path is None else None, set(e.tags)
            )
            for k, e in index.items()
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(pickle.dumps(slim, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, path)
    return index


def _unresolved(index: dict, names: list[str]) -> set[str]:
    """Names (the suite's tasks, and recursively its groups' members) that ``index`` does not define."""
    from lm_eval.tasks._index import Kind

    missing, seen, todo = set(), set(), list(names)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        e = index.get(n)
        if e is None:
            missing.add(n)
        elif e.kind == Kind.GROUP:
            members = (e.cfg or {}).get("task") or []
            todo += [m for m in (members if isinstance(members, list) else [members]) if isinstance(m, str)]
        elif e.kind == Kind.TAG:
            todo += sorted(e.tags)
    return missing


def task_manager(suite: dict, registry_cache: str | None = None):
    """The suite's TaskManager: its include_path's tasks, over the harness's registry when the suite
    names a task (or a group member) the include_path does not define, or has no include_path."""
    from lm_eval.tasks import TaskManager

    root = suite.get("dir")
    custom = TaskManager(include_path=root, include_defaults=False) if root else None
    with_registry = custom is None or bool(_unresolved(custom.task_index, list(suite["tasks"])))
    key = (root, with_registry)
    if key in _MANAGERS:
        return _MANAGERS[key]
    tm = custom or TaskManager(include_defaults=False)
    if with_registry:  # as TaskManager(include_defaults=True) would index it: include_path entries win
        _reindex(tm, {**registry_index(registry_cache), **tm.task_index})
    _MANAGERS[key] = tm
    return tm


def _reindex(tm, index: dict) -> None:
    """Give a TaskManager another index (what its constructor derives from the index, lm_eval 0.4.13)."""
    from lm_eval.tasks._index import Kind

    tm._index = index
    tm._all_tasks = sorted(index)
    tm._all_subtasks = sorted(k for k, e in index.items() if e.kind in (Kind.TASK, Kind.PY_TASK))
    tm._all_groups = sorted(k for k, e in index.items() if e.kind == Kind.GROUP)
    tm._all_tags = sorted(k for k, e in index.items() if e.kind == Kind.TAG)


def _hub_dataset_problem(cfg: dict, where: str) -> str | None:
    """Offline: a task's Hugging Face dataset that the local datasets cache lacks (what the harness's
    ``datasets.load_dataset`` would fail on after the models were loaded), with how to fetch it."""
    import datasets

    path, name = cfg["dataset_path"], cfg.get("dataset_name")
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    kwargs.pop("trust_remote_code", None)  # as the harness does with datasets >= 4
    try:
        datasets.load_dataset_builder(path=path, name=name, **kwargs)
        return None
    except Exception as e:  # noqa: BLE001 - ConnectionError (not cached), ValueError (config not cached), ...
        err = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    call = (
        f"datasets.load_dataset({path!r}"
        + (f", {name!r}" if name else "")
        + "".join(f", {k}={v!r}" for k, v in kwargs.items())
        + ")"
    )
    cache = datasets.config.HF_DATASETS_CACHE
    return (
        f"{where}: its dataset {path!r}" + (f" (config {name!r})" if name else "") + " is not in the local "
        f"Hugging Face datasets cache ({cache}) and the harness runs offline (HF_DATASETS_OFFLINE=1), so the "
        f'task cannot load ({err}). On a machine with network access, run `python -c "import datasets; '
        f'{call}"` (it fills $HF_HOME/datasets, by default ~/.cache/huggingface/datasets) and copy that '
        f"directory to {cache} here (or point HF_HOME at the copy); `huggingface-cli download --repo-type "
        f"dataset {path}` alone is not enough: offline, datasets reads only its own cache. Or set "
        f"`lm_eval.offline: false` where the hub is reachable."
    )


def _leaf_configs(tm, name: str, where: str, problems: list[str], seen: set | None = None) -> list[tuple[str, dict]]:
    """(task name, resolved config) of a task, or of every task of a group (recursively)."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    seen = seen if seen is not None else set()
    entry = tm.task_index.get(name)
    if entry is None or name in seen:
        return []
    seen.add(name)
    cfg = load_yaml(entry.yaml_path, resolve_func=True) if entry.yaml_path else dict(entry.cfg or {})
    if entry.kind == Kind.GROUP:
        out = []
        members = cfg.get("task") or []
        for m in members if isinstance(members, list) else [members]:
            if isinstance(m, str):
                if tm.task_index.get(m) is None:
                    problems.append(
                        f"{where}: group {name!r} ({entry.yaml_path.name}) lists task {m!r}, which no YAML file defines"
                    )
                out += _leaf_configs(tm, m, where, problems, seen)
            elif isinstance(m, dict) and "task" in m:
                out.append((str(m["task"]), m))
        return out
    if entry.kind == Kind.TAG:
        problems.append(f"{where}: {name!r} is a tag, not a task or group; list its tasks, or make it a group")
        return []
    if entry.yaml_path and isinstance(cfg.get("metadata", {}), dict) and "config_source" not in cfg.get("metadata", {}):
        cfg["metadata"] = {**cfg.get("metadata", {}), "config_source": _shown_path(entry.yaml_path)}
    return [(name, cfg)]


def _shown_path(p: Path) -> str:
    """A task file as the reader knows it: ``lm_eval/tasks/...`` for the registry's, else its path."""
    reg = _registry_dir()
    return f"lm_eval/tasks/{Path(p).relative_to(reg)}" if Path(p).is_relative_to(reg) else Path(p).name


def _static_checks(task: str, cfg: dict, root: Path | None, suite: dict, problems: list[str]) -> None:
    metric_registry, aggregation_registry, filter_registry = _registries()
    from lm_eval.api.registry import DEFAULT_METRIC_REGISTRY

    where = f"suite {suite['name']}: task {task!r} ({cfg.get('metadata', {}).get('config_source') or 'YAML'})"
    custom = callable(cfg.get("process_results"))
    output_type = cfg.get("output_type", "generate_until")
    metrics = cfg.get("metric_list") or [{"metric": m} for m in DEFAULT_METRIC_REGISTRY.get(output_type, [])]
    names = []
    for mc in metrics:
        m = mc.get("metric")
        name = m.__name__ if callable(m) else m
        names.append(name)
        if callable(m) or custom:
            pass  # a !function metric, or process_results: local code shipped with the task
        elif mc.get("hf_evaluate") is True:
            problems.append(
                f"{where}: metric {name!r} has `hf_evaluate: true` (evaluate.load from the Hugging Face hub); only "
                "local metrics are allowed: a built-in one or a `!function` shipped with the task"
            )
        elif name not in metric_registry:
            problems.append(
                f"{where}: metric {name!r} is not a built-in lm_eval metric, so the harness would fetch it "
                f"with evaluate.load from the Hugging Face hub; only local metrics are allowed (built-in: "
                f"{', '.join(sorted(metric_registry)[:12])}, ...; or `metric: !function module.fn`)"
            )
        agg = mc.get("aggregation")
        if isinstance(agg, str) and agg not in aggregation_registry:
            problems.append(f"{where}: metric {name!r}: unknown aggregation {agg!r}")
    gated = suite.get("metric") or (names[0] if names else None)
    if gated not in names:
        problems.append(f"{where}: lm_eval.metric {gated!r} is not among the task's metrics {names}")
    else:
        mc = metrics[names.index(gated)]
        agg = mc.get("aggregation")
        if agg is None and not callable(mc.get("metric")):
            from lm_eval.api.registry import METRIC_AGGREGATION_REGISTRY

            agg = METRIC_AGGREGATION_REGISTRY.get(gated)
        agg_name = agg if isinstance(agg, str) else getattr(agg, "__name__", None)
        if agg_name != "mean":
            problems.append(
                f"{where}: the gated metric {gated!r} aggregates by {agg_name!r}, not 'mean': the gate "
                "judges per-document scores whose mean is the suite's score (pick a per-document metric "
                "with `lm_eval.metric`)"
            )
    filters = [fl.get("name") for fl in cfg.get("filter_list") or []] or ["none"]
    for fl in cfg.get("filter_list") or []:
        for fn in fl.get("filter", []):
            f = fn.get("function")
            if isinstance(f, str) and f not in filter_registry:
                problems.append(
                    f"{where}: filter {fl.get('name')!r} uses unknown function {f!r} (known: "
                    f"{', '.join(sorted(filter_registry))})"
                )
    if suite.get("filter") and suite["filter"] not in filters:
        problems.append(f"{where}: lm_eval.filter {suite['filter']!r} is not among the task's filters {filters}")
    if cfg.get("dataset_path") in _LOCAL_BUILDERS:
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        split_files = files if isinstance(files, dict) else {"train": files} if files else {}
        for split, fs in split_files.items():
            for f in [fs] if isinstance(fs, str) else list(fs or []):
                p = Path(f) if Path(f).is_absolute() else (root or Path.cwd()) / f
                if not any(ch in str(f) for ch in "*?[") and not p.is_file():
                    problems.append(
                        f"{where}: data file for split {split!r} not found: {f} (looked for {p}; "
                        "relative paths are relative to the include_path)"
                    )
        for k in ("test_split", "validation_split", "training_split", "fewshot_split"):
            if cfg.get(k) and split_files and cfg[k] not in split_files:
                problems.append(f"{where}: {k} {cfg[k]!r} is not one of the data_files splits {sorted(split_files)}")
    elif (
        suite.get("offline", True)
        and isinstance(cfg.get("dataset_path"), str)
        and "class" not in cfg
        and not callable(cfg.get("custom_dataset"))
        and not Path(cfg["dataset_path"]).is_dir()
    ):
        problem = _hub_dataset_problem(cfg, where)  # a hub dataset: it must be in the local datasets cache
        if problem:
            problems.append(problem)


def _prepare(task, suite: dict) -> None:
    """What ``simple_evaluate`` does to a loaded task before it runs (same order, same rules)."""
    if task.get_config("output_type") == "generate_until" and suite.get("gen_kwargs"):
        task.set_config(key="generation_kwargs", value=dict(suite["gen_kwargs"]), update=True)
    if suite.get("num_fewshot") is not None:
        if task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=suite["num_fewshot"])
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=suite["seed"])


def _chat_fn(tokenizer):
    from types import SimpleNamespace

    from lm_eval.models.huggingface import HFLM

    holder = SimpleNamespace(tokenizer=tokenizer, chat_template_args={})
    return lambda history, add_generation_prompt=True: HFLM.apply_chat_template(holder, history, add_generation_prompt)


def _tokenizer_dir(model: dict) -> str:
    """The tokenizer a model answers with: the adapter's when the adapter directory carries one (the
    project's loader does the same), else the base's."""
    a = model.get("adapter")
    return a if a and (Path(a) / "tokenizer_config.json").exists() else model["path"]


def _prompts(task, suite: dict, tokenizer) -> dict[int, str]:
    """doc_id -> the context of the document's first request, as the harness will build it."""
    task.set_fewshot_seed(seed=suite["seed"])  # the sampler's RNG restarts, as on a fresh load
    chat = bool(suite.get("apply_chat_template"))
    task.build_all_requests(
        limit=suite.get("limit"),
        rank=0,
        world_size=1,
        cache_requests=False,
        system_instruction=suite.get("system_instruction"),
        apply_chat_template=chat,
        fewshot_as_multiturn=bool(suite.get("fewshot_as_multiturn")),
        chat_template=_chat_fn(tokenizer) if chat else None,
        tokenizer_name=tokenizer.name_or_path.replace("/", "__") if chat else "",
    )
    first: dict[int, tuple[int, str]] = {}
    for inst in task.instances:
        if inst.doc_id not in first or inst.idx < first[inst.doc_id][0]:
            first[inst.doc_id] = (inst.idx, inst.arguments[0])
    return {d: p for d, (_, p) in sorted(first.items())}


def preflight(job: dict) -> dict:
    """Every suite's tasks checked and their documents read, prompts rendered per model; no model loaded.
    Raises :class:`Refused` with every problem of every suite."""
    problems: list[str] = []
    out: dict = {}
    tokenizers: dict = {}
    for suite in job["suites"]:
        entry, found = _preflight_suite(job, suite, tokenizers)
        problems += found
        if entry is not None:
            out[suite["name"]] = entry
    if problems:
        raise Refused(problems)
    return out


def _preflight_suite(job: dict, suite: dict, tokenizers: dict) -> tuple[dict | None, list[str]]:
    from lm_eval.utils import handle_non_serializable, hash_string

    problems: list[str] = []
    name, root = suite["name"], Path(suite["dir"]) if suite.get("dir") else None
    where = f"suite {name}"
    shown = suite.get("include_path") or (str(root) if root else None)
    if root is not None and not root.is_dir():
        return None, [f"{where}: include_path {shown} is not a directory"]
    errors = _yaml_errors(root) if root is not None else {}
    if root is not None:
        os.chdir(root)
    tm = task_manager(suite, job.get("registry_cache"))
    leaves: list[tuple[str, dict]] = []
    for t in suite["tasks"]:
        if tm.task_index.get(t) is None:
            problems.append(_unknown_task(where, t, shown, root, errors, tm))
            continue
        leaves += _leaf_configs(tm, t, where, problems)
    for task_name, cfg in leaves:
        _static_checks(task_name, cfg, root, suite, problems)
    if problems:
        return None, problems
    try:
        loaded = tm.load(list(suite["tasks"]))
    except Exception as e:
        return None, [
            f"{where}: the harness could not build the tasks: {type(e).__name__}: {' '.join(str(e).split())[:400]}"
        ]
    groups = _group_members(loaded)
    tasks_out, docs_out = {}, {}
    for leaf, task in loaded["tasks"].items():
        _prepare(task, suite)
        mnames = list(task._metric_fn_list)
        metric = suite.get("metric") or mnames[0]
        if task._metric_fn_list.get(metric) is None and task.config.process_results is None:
            problems.append(f"{where}: task {leaf!r}: metric {metric!r} did not resolve to a local function")
        docs = []
        for doc_id, doc in task.doc_iterator(rank=0, limit=suite.get("limit"), world_size=1):
            text = _decontamination_text(task, doc)
            cat = leaf
            if suite.get("category_field"):
                if suite["category_field"] not in doc:
                    problems.append(
                        f"{where}: task {leaf!r} document {doc_id} has no field "
                        f"{suite['category_field']!r} (lm_eval.category_field); fields: {sorted(doc)}"
                    )
                    break
                cat = str(doc[suite["category_field"]])
            docs.append(
                {
                    "doc_id": doc_id,
                    "doc_hash": hash_string(
                        json.dumps(doc, indent=2, default=handle_non_serializable, ensure_ascii=False)
                    ),
                    "text": text if isinstance(text, str) else str(text),
                    "category": cat,
                }
            )
        tasks_out[leaf] = {
            "output_type": task.OUTPUT_TYPE,
            "metric": metric,
            "filter": suite.get("filter") or task._filters[0].name,
            "metrics": mnames,
            "filters": [f.name for f in task._filters],
            "group": next((g for g, subs in groups.items() if leaf in subs), None),
            "num_fewshot": task.get_config("num_fewshot"),
            "documents": len(docs),
            "version": (task.config.metadata or {}).get("version"),
            "config_source": str((task.config.metadata or {}).get("config_source") or ""),
        }
        docs_out[leaf] = docs
    entry = {"tasks": tasks_out, "docs": docs_out, "prompts": {}}
    if job["mode"] != "evaluate" or problems:
        return entry, problems
    from transformers import AutoTokenizer

    for m in job["models"]:
        d = _tokenizer_dir(m)
        tok = tokenizers.get(d) or tokenizers.setdefault(d, AutoTokenizer.from_pretrained(d))
        if suite.get("apply_chat_template") and not getattr(tok, "chat_template", None):
            problems.append(
                f"{where}: apply_chat_template is on but the {m['role']}'s tokenizer ({d}) has no chat template"
            )
            continue
        entry["prompts"][m["role"]] = {
            leaf: {str(k): hash_string(v) for k, v in _prompts(task, suite, tok).items()}
            for leaf, task in loaded["tasks"].items()
        }
    mismatch = prompt_mismatches(name, entry, job["models"])
    if mismatch:
        problems += _with_example_prompts(mismatch, loaded, suite, job["models"], tokenizers)
    return entry, problems


def _unknown_task(where: str, task: str, shown: str | None, root: Path | None, errors: dict[str, str], tm) -> str:
    import difflib

    import lm_eval

    places = (
        f"any YAML file in include_path {shown} nor " if shown else ""
    ) + f"the harness's task registry (lm_eval {getattr(lm_eval, '__version__', '?')}, lm_eval/tasks)"
    msg = f"{where}: task {task!r} is not defined by {places}"
    if errors:
        msg += "; these YAML files did not load: " + "; ".join(f"{k}: {v}" for k, v in errors.items())
    close = difflib.get_close_matches(task, list(tm.task_index), n=5, cutoff=0.75)
    if close:
        msg += f"; close names: {close}"
    elif root is not None and not errors:
        local = sorted(k for k, e in tm.task_index.items() if e.yaml_path and Path(e.yaml_path).is_relative_to(root))
        msg += f"; tasks defined there: {local[:20]}"
    return msg


def _decontamination_text(task, doc: dict):
    """A document's decontamination query, as ``Task.doc_to_decontamination_query`` means it, except that
    a template query is the rendered text: lm_eval 0.4.13 ``ast.literal_eval``s the rendering, a
    SyntaxError on prose such as the library's ARC query ``Question: {{question}}...``."""
    from lm_eval.utils import apply_template

    q = task.config.doc_to_decontamination_query if task.should_decontaminate() else None
    if q is None:
        return task.doc_to_text(doc)
    if callable(q):
        return q(doc)
    if q in task.features:
        return doc[q]
    return apply_template(q, doc)


def _group_members(loaded: dict) -> dict[str, list[str]]:
    return {str(g): [str(x) for x in subs] for g, subs in (loaded.get("group_map") or {}).items()}


def prompt_mismatches(suite: str, entry: dict, models: list[dict]) -> list[str]:
    """Problems for every task whose prompts differ between the models (base first)."""
    roles = [m["role"] for m in models]
    if len(roles) < 2 or any(r not in entry["prompts"] for r in roles):
        return []
    ref = roles[0]
    out = []
    for leaf, hashes in entry["prompts"][ref].items():
        for r in roles[1:]:
            other = entry["prompts"][r].get(leaf, {})
            bad = [d for d in hashes if other.get(d) != hashes[d]]
            if bad:
                out.append(
                    f"suite {suite}: task {leaf!r}: the {r} would be asked different prompts than the {ref} for "
                    f"{len(bad)} of {len(hashes)} documents (prompt hash mismatch, e.g. document {bad[0]}); "
                    f"the two models' tokenizers render different chat templates, so their scores would not "
                    f"be paired on the same question"
                )
    return out


def _with_example_prompts(problems, loaded, suite, models, tokenizers) -> list[str]:
    """Add the first differing prompt pair to the first mismatch message (the reader sees what differs)."""
    out = []
    for p in problems:
        if "prompt hash mismatch" in p and "task '" in p:
            leaf = p.split("task '")[1].split("'")[0]
            task = loaded["tasks"].get(leaf)
            if task is not None and len(models) >= 2:
                a = _prompts(task, suite, tokenizers[_tokenizer_dir(models[0])])
                b = _prompts(task, suite, tokenizers[_tokenizer_dir(models[1])])
                d = next((k for k in a if a[k] != b.get(k)), None)
                if d is not None:
                    p += f": {models[0]['role']} {a[d][-120:]!r} vs {models[1]['role']} {b.get(d, '')[-120:]!r}"
        out.append(p)
    return out


# ---------------------------------------------------------------------------------------------- evaluate


def _load(model: dict):
    from campaign_orchestrator.generation.local import LocalModel

    g = LocalModel.from_path(
        model["path"],
        model.get("adapter"),
        bool(model.get("load_in_4bit")),
        model.get("compute_dtype") or "bfloat16",
        batch_size=1,
        device=model.get("device"),
    )
    return g.model, g.tok


def _sample_row(s: dict, task, metric: str, output_type: str) -> dict:
    row = {
        "doc_id": s["doc_id"],
        "doc_hash": s["doc_hash"],
        "prompt_hash": s["prompt_hash"],
        "prompt": s["arguments"][0][0],
        "score": None if s.get(metric) is None else float(s[metric]),
    }
    fr = s["filtered_resps"]
    if output_type == "multiple_choice":
        lls = [float(x[0]) for x in fr]
        choices = task.doc_to_choice(s["doc"])
        best = max(range(len(lls)), key=lls.__getitem__)
        target = s["target"]
        row |= {
            "loglikelihoods": lls,
            "choice": best,
            "output": str(choices[best]),
            "reference": str(choices[target])
            if isinstance(target, int) and 0 <= target < len(choices)
            else str(target),
        }
    else:
        row |= {
            "output": fr if isinstance(fr, str) else str(fr[0] if isinstance(fr, list) and fr else fr),
            "raw": s["resps"][0][0] if s.get("resps") and s["resps"][0] else None,
            "reference": str(s["target"]),
        }
    return row


def evaluate(job: dict, pre: dict) -> dict:
    import random

    import lm_eval
    import lm_eval.evaluator as ev
    import numpy as np
    import torch
    from lm_eval.models.huggingface import HFLM

    ev.add_env_info = lambda results: None  # torch.utils.collect_env: ~2 s of subprocesses, nothing we use
    runs: dict = {s["name"]: {} for s in job["suites"]}
    for m in job["models"]:
        t0 = time.perf_counter()
        LOADED.append(m["role"])
        model, tok = _load(m)
        lm = HFLM(pretrained=model, tokenizer=tok, batch_size=int(job.get("batch_size") or 16))
        emit("model_loaded", role=m["role"], seconds=time.perf_counter() - t0)
        for suite in job["suites"]:
            t1 = time.perf_counter()
            if suite.get("dir"):
                os.chdir(suite["dir"])
            tm = task_manager(suite, job.get("registry_cache"))  # the preflight's (built once per process)
            seed = suite["seed"]
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
            res = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(suite["tasks"]),
                task_manager=tm,
                num_fewshot=suite.get("num_fewshot"),
                limit=suite.get("limit"),
                gen_kwargs=dict(suite["gen_kwargs"]) if suite.get("gen_kwargs") else None,
                apply_chat_template=bool(suite.get("apply_chat_template")),
                system_instruction=suite.get("system_instruction"),
                fewshot_as_multiturn=bool(suite.get("fewshot_as_multiturn")),
                log_samples=True,
                bootstrap_iters=0,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
            info = pre[suite["name"]]["tasks"]
            loaded = tm.load(list(info))  # for doc_to_choice only (documents are not re-run)
            samples, aggregates = {}, {}
            for leaf, meta in info.items():
                key = f"{meta['metric']},{meta['filter']}"
                aggregates[leaf] = res["results"].get(leaf, {}).get(key)
                samples[leaf] = [
                    _sample_row(s, loaded["tasks"][leaf], meta["metric"], meta["output_type"])
                    for s in res["samples"].get(leaf, [])
                    if s["filter"] == meta["filter"]
                ]
            seconds = time.perf_counter() - t1
            runs[suite["name"]][m["role"]] = {
                "seconds": seconds,
                "aggregates": aggregates,
                "samples": samples,
                "n_samples": res.get("n-samples"),
                "versions": res.get("versions"),
                "n_shot": res.get("n-shot"),
            }
            emit(
                "suite_done",
                role=m["role"],
                suite=suite["name"],
                seconds=seconds,
                docs=sum(len(v) for v in samples.values()),
            )
        del lm, model
    return runs


def main(argv: list[str]) -> int:
    job_path, out_path = argv[1], argv[2]
    job = json.loads(Path(job_path).read_text())
    t0 = time.perf_counter()
    base = {"mode": job["mode"], "models_loaded": LOADED}
    try:
        import torch

        if job.get("threads"):
            torch.set_num_threads(int(job["threads"]))
        import lm_eval

        base["lm_eval_version"] = getattr(lm_eval, "__version__", None)
        pre = preflight(job)
        emit("preflight", seconds=time.perf_counter() - t0)
        out = {**base, "status": "ok", "suites": pre}
        if job["mode"] == "evaluate":
            runs = evaluate(job, pre)
            for name, r in runs.items():
                out["suites"][name]["runs"] = r
        out["seconds"] = time.perf_counter() - t0
        _dump(out, out_path)
        return 0
    except Refused as e:
        _dump(
            {
                **base,
                "status": "refused",
                "stage": e.stage,
                "problems": e.problems,
                "seconds": time.perf_counter() - t0,
            },
            out_path,
        )
        return 2
    except BaseException as e:  # the parent reports it; the traceback goes with it
        _dump(
            {
                **base,
                "status": "error",
                "error_type": type(e).__name__,
                "error": str(e),
                "traceback": traceback.format_exc(),
                "seconds": time.perf_counter() - t0,
            },
            out_path,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
