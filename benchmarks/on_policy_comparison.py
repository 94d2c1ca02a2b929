"""Off-policy sequence KD vs off-policy logit KD vs on-policy reverse KL, side by side (issue 26).

Per task, three campaigns that differ only in the loss run end to end (`campaign run`, each its own Dagster
run, one artifact root per task so the two off-policy arms share the teacher stage through its cache):

- ``sequence``: the teacher generates an answer per training prompt (the existing teacher stage), the student
  imitates it (cross-entropy);
- ``logits``: the same generations, plus forward KL on the teacher's top-20 (``kl_weight`` 0.8, as shipped);
- ``on_policy``: no teacher stage; the student samples, the teacher scores the samples in process (one prefill
  each), reverse KL (``beta`` 1, ``lambda`` 1), as ``campaigns/smollm2_on_policy.yaml``.

Same model (SmolLM2-135M-Instruct as teacher, with the task's system prompt and few-shot turns, and as LoRA
student), same training prompts, same optimizer steps (``--steps``), same evaluation items. Each arm keeps its
shipped learning rate (``campaigns/smollm2.yaml``: 5e-4 off-policy; ``smollm2_on_policy.yaml``: 2e-3).

Tasks: ``plurals`` (the shipped real-model campaign's context distillation, campaigns/smollm2.yaml's data) and
``past_tense`` (the same shape for regular English verbs: "Past tense of walk?" -> "walked", data written here);
both ride the shipped general questions along as replay (asked to the teacher bare) and judge general ability
on the shipped general suite.

Per arm: task score with its paired 95% interval vs the base (the gate's paired bootstrap), general-suite delta
vs the base (same), teacher tokens paid (off-policy: the teacher stage's prompt + completion tokens, each
off-policy arm charged in full even when the second one reads the first one's cache; on-policy: prefill
tokens), what those tokens would cost at an API teacher's prices (the catalog's ``api-open-70b``: input and
output per million; on-policy is input only, plus one output token per scored sample as vLLM needs), wall
time, the ledger's spend on this host and the cost per point gained at the lower bound of the paired interval.

Shrunk to fit a shared 2-core CPU (see ``--help``): a subset of the training prompts, few steps, a subset of
each suite, the teacher not evaluated. Prints JSON; exits 1 when on-policy misses the issue's goal (task score
>= the best off-policy arm's, general regression no larger, <= 1/2 of its teacher cost) on any task, so the
result is never quietly good.

    .venv/bin/python benchmarks/on_policy_comparison.py                 # both tasks, ~40 min on 2 loaded cores
    .venv/bin/python benchmarks/on_policy_comparison.py --tasks plurals --steps 8 --eval-items 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DATA = REPO / "campaigns" / "data" / "smollm2"
ARMS = ("sequence", "logits", "on_policy")
API_PRICE_KEY = "api-open-70b"

# past_tense: regular verbs only (-ed, or -d after a final e), train and evaluation disjoint
PAST_TRAIN = (
    "walk talk jump play cook clean paint call open watch help work look kick pull push wash climb listen "
    "laugh fill visit answer start finish learn turn follow need want wait ask like move love smile dance "
    "close bake hope live use rest count print mark park pick"
).split()
PAST_EVAL = (
    "brush check crash dress fix kiss miss pass point pour rush sail shout spell test thank touch train trust "
    "join lift melt pump hunt land paste share smell type wave"
).split()
PAST_FEWSHOT = ("jump", "bake", "open", "smile", "cook", "dance")
PAST_SYSTEM = (
    "If the user asks for the past tense of a verb, reply with only the past tense in lowercase. For any "
    "other question, answer normally in one full sentence."
)


def past(verb: str) -> str:
    return verb + ("d" if verb.endswith("e") else "ed")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def task_data(task: str, n_task: int, n_general: int, n_eval: int) -> dict:
    """Training prompts (task + general replay), the task suite, the general suite and the teacher's context."""
    general_train = _jsonl(DATA / "train-general.jsonl")[:n_general]
    general_suite = _jsonl(DATA / "suite-general.jsonl")[:n_eval]
    base = yaml.safe_load((REPO / "campaigns" / "smollm2.yaml").read_text())
    if task == "plurals":
        train = _jsonl(DATA / "train-plural.jsonl")[:n_task]
        suite = _jsonl(DATA / "suite-plural.jsonl")[:n_eval]
        context, category = base["teacher"]["context"], "plural"
    elif task == "past_tense":
        category = "past_tense"
        train = [
            {"id": f"pt-tr-{i:03d}", "prompt": f"Past tense of {v}?", "reference": past(v), "category": category}
            for i, v in enumerate(v for v in PAST_TRAIN if v not in PAST_FEWSHOT)
        ][:n_task]
        suite = [
            {"id": f"pt-te-{i:03d}", "prompt": f"Past tense of {v}?", "reference": past(v), "category": category}
            for i, v in enumerate(PAST_EVAL)
        ][:n_eval]
        pairs = base["teacher"]["context"][1:]
        general_pairs = [pairs[i : i + 2] for i in range(0, len(pairs), 2) if "Plural" not in pairs[i]["content"]]
        context = [{"role": "system", "content": PAST_SYSTEM}]
        for i, v in enumerate(PAST_FEWSHOT):  # interleaved as the plurals context: task turn, general turn
            context += [{"role": "user", "content": f"Past tense of {v}?"}, {"role": "assistant", "content": past(v)}]
            context += general_pairs[i] if i < len(general_pairs) else []
        if context[-1]["role"] == "user":
            context = context[:-1]
    else:
        raise SystemExit(f"unknown task {task!r}: plurals or past_tense")
    return {
        "train": train,
        "general_train": general_train,
        "suite": suite,
        "general_suite": general_suite,
        "context": context,
        "category": category,
    }


def campaign_yaml(task: str, arm: str, data: dict, steps: int, eval_items: int, seed: int) -> dict:
    """The arm's campaign: campaigns/smollm2.yaml (off-policy) or smollm2_on_policy.yaml (on-policy), with the
    task's data and context, ``steps`` optimizer steps and the shrunk suites."""
    src = "smollm2_on_policy.yaml" if arm == "on_policy" else "smollm2.yaml"
    c = yaml.safe_load((REPO / "campaigns" / src).read_text())
    c["name"] = f"cmp_{task}_{arm}"
    c["description"] = f"benchmarks/on_policy_comparison.py: {task}, {arm}"
    c["teacher"]["context"] = data["context"]
    c["teacher"]["context_categories"] = [data["category"]]
    c["data"]["source"] = "campaigns/data/train-*.jsonl"
    tr = c["training"]
    tr.pop("epochs", None)
    tr["max_steps"] = steps
    tr["seed"] = seed
    if arm == "on_policy":
        op = tr["distillation"]["on_policy"]
        # 2 steps per round of 4 x 2 samples, as shipped
        op["samples_per_round"] = tr["micro_batch_size"] * tr["gradient_accumulation_steps"] * 2
    else:
        tr["distillation"] = {"loss": "sequence"} if arm == "sequence" else {"loss": "logits", "kl_weight": 0.8}
        c["teacher"]["sampling"]["logprobs"] = 20  # both off-policy arms: one teacher stage (the logit arm's)
    ev = c["evaluation"]
    ev["suites"][0]["source"] = "campaigns/data/suite-task.jsonl"
    ev["suites"][0]["name"] = task
    ev["suites"][1]["source"] = "campaigns/data/suite-general.jsonl"
    ev["score_teacher"] = False
    ev["gate"]["min_items"] = min(ev["gate"].get("min_items", 20), eval_items)
    c.setdefault("cost", {})["budget_usd"] = 5.0
    return c


def write_project(root: Path, task: str, data: dict, steps: int, eval_items: int, seed: int) -> dict[str, Path]:
    camp = root / "campaigns"
    _write_jsonl(camp / "data" / "train-task.jsonl", data["train"])
    _write_jsonl(camp / "data" / "train-general.jsonl", data["general_train"])
    _write_jsonl(camp / "data" / "suite-task.jsonl", data["suite"])
    _write_jsonl(camp / "data" / "suite-general.jsonl", data["general_suite"])
    (camp / "pricing").mkdir(parents=True, exist_ok=True)
    (camp / "pricing" / "catalog.yaml").write_text((REPO / "campaigns" / "pricing" / "catalog.yaml").read_text())
    files = {}
    for arm in ARMS:
        f = camp / f"cmp_{task}_{arm}.yaml"
        f.write_text(yaml.safe_dump(campaign_yaml(task, arm, data, steps, eval_items, seed), sort_keys=False))
        files[arm] = f
    return files


def _stage_manifest(artifacts: Path, campaign: str, stage: str) -> dict | None:
    found = sorted((artifacts / campaign / stage).glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text()) if found else None


def _suite(gate: dict, name: str) -> dict:
    s = next(x for x in gate["suites"] if x["suite"] == name)
    o = s["overall"]
    d = o["delta"]
    return {
        "candidate": o["candidate"]["estimate"],
        "base": o["base"]["estimate"],
        "delta": d["estimate"],
        "delta_lo": d["lo"],
        "delta_hi": d["hi"],
        "items": o["n"],
        "verdict": s["verdict"],
    }


def run_arm(project: Path, artifacts: Path, yaml_file: Path, task: str, arm: str, catalog) -> dict:
    campaign = yaml_file.stem
    env = os.environ | {"CAMPAIGN_PROJECT_DIR": str(project), "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    p = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "campaign"),
            "run",
            str(yaml_file),
            "--artifacts",
            str(artifacts),
            "--log-level",
            "WARNING",
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    (artifacts / f"{campaign}.log").write_text(p.stdout + p.stderr)
    ev = _stage_manifest(artifacts, campaign, "evaluation")
    if ev is None:
        return {
            "arm": arm,
            "error": f"campaign run exited {p.returncode} without an evaluation: {(p.stdout + p.stderr)[-1500:]}",
            "wall_s": wall,
        }
    gate = json.loads(Path(ev["gate_path"]).read_text())
    from campaign_orchestrator.costs.ledger import Ledger

    lines = Ledger(artifacts / "cost_ledger.duckdb").lines(campaign)
    by_kind: dict[str, float] = {}
    for line in lines:
        by_kind[line["kind"]] = by_kind.get(line["kind"], 0.0) + float(line["usd"])
    in_usd, out_usd = catalog.get(API_PRICE_KEY).token_usd()
    adapter = _stage_manifest(artifacts, campaign, "student_adapter") or {}
    summary = adapter.get("summary") or {}
    if arm == "on_policy":
        op = summary.get("on_policy") or {}
        prompt_t, completion_t = int(op.get("teacher_prefill_tokens", 0)), 0
        scored = int(op.get("samples", 0))
        api_usd = prompt_t / 1e6 * in_usd + scored / 1e6 * out_usd  # one generated token per scored sample (vLLM)
        teacher = {
            "teacher_tokens": prompt_t,
            "teacher_prefill_tokens": prompt_t,
            "student_samples": scored,
            "rounds": op.get("rounds"),
            "sampling_s": op.get("sampling_seconds"),
            "scoring_s": op.get("scoring_seconds"),
            "first_round_reverse_kl": op.get("first_round_reverse_kl"),
            "last_round_reverse_kl": op.get("last_round_reverse_kl"),
        }
        teacher_host_usd = 0.0  # in process: its time is in the training line
    else:
        tg = _stage_manifest(artifacts, campaign, "teacher_generations") or {}
        prompt_t, completion_t = int(tg.get("prompt_tokens", 0)), int(tg.get("completion_tokens", 0))
        api_usd = prompt_t / 1e6 * in_usd + completion_t / 1e6 * out_usd
        teacher = {
            "teacher_tokens": prompt_t + completion_t,
            "teacher_prompt_tokens": prompt_t,
            "teacher_completion_tokens": completion_t,
            "teacher_generations": tg.get("rows"),
        }
        teacher_host_usd = sum(float(x["usd"]) for x in tg.get("cost_lines") or [])
    task_s, general = _suite(gate, task), _suite(gate, "general")
    spent = sum(by_kind.values())
    # a cache hit pays nothing in the ledger: charge the arm the teacher stage it used, as if it ran alone
    full_usd = spent - by_kind.get("teacher", 0.0) + teacher_host_usd
    low_pts = task_s["delta_lo"] * 100
    return {
        "arm": arm,
        "campaign": campaign,
        "exit_code": p.returncode,
        "verdict": gate["verdict"],
        "task": task_s,
        "general": general,
        **teacher,
        "teacher_usd_at_api_price": api_usd,
        "api_price": f"{API_PRICE_KEY}: ${in_usd}/M in, ${out_usd}/M out",
        "wall_s": wall,
        "train_s": summary.get("train_seconds"),
        "steps": summary.get("steps"),
        "ledger_usd_this_run": spent,
        "usd_with_its_teacher_stage": full_usd,
        "usd_per_point_gained_lcb": full_usd / low_pts if low_pts > 0 else None,
        "usd_per_point_gained_lcb_api_teacher": (full_usd - teacher_host_usd + api_usd) / low_pts
        if low_pts > 0
        else None,
    }


def verdict(arms: dict) -> dict:
    off = [arms[a] for a in ("sequence", "logits") if "task" in arms.get(a, {})]
    on = arms.get("on_policy", {})
    if not off or "task" not in on:
        return {"met": False, "why": "an arm did not finish"}
    best = max(off, key=lambda a: (a["task"]["candidate"], a["general"]["delta"]))
    checks = {
        "task_score_at_least_best_off_policy": on["task"]["candidate"] >= best["task"]["candidate"],
        "general_regression_no_larger": on["general"]["delta"] >= best["general"]["delta"],
        "teacher_cost_at_most_half": on["teacher_usd_at_api_price"] <= best["teacher_usd_at_api_price"] / 2,
    }
    return {
        "best_off_policy": best["arm"],
        **checks,
        "met": all(checks.values()),
        "teacher_cost_ratio_on_vs_best": on["teacher_usd_at_api_price"] / best["teacher_usd_at_api_price"]
        if best["teacher_usd_at_api_price"]
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="plurals,past_tense")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per arm (shipped: 2 epochs / 30 steps)")
    ap.add_argument("--task-prompts", type=int, default=48, help="training prompts of the task (shipped: 198)")
    ap.add_argument("--general-prompts", type=int, default=24, help="general replay prompts (shipped: 200)")
    ap.add_argument("--eval-items", type=int, default=30, help="items per suite (shipped: 120 task, 150 general)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--workdir", help="keep the projects and artifact roots here (default: a temporary directory)")
    a = ap.parse_args(argv)
    from campaign_orchestrator.costs.catalog import read_catalog

    catalog = read_catalog(REPO / "campaigns" / "pricing" / "catalog.yaml")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="on-policy-cmp-"))
    t_all = time.perf_counter()
    load0 = os.getloadavg()
    report = {
        "benchmark": "on_policy_comparison",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "runs_per_arm": 1,
        "seed": a.seed,
        "model": "@packaged/smollm2-135m-instruct (teacher with context, LoRA student)",
        "shrunk": {
            "steps": a.steps,
            "task_prompts": a.task_prompts,
            "general_prompts": a.general_prompts,
            "eval_items_per_suite": a.eval_items,
            "teacher_evaluated": False,
        },
        "workdir": str(work),
        "tasks": {},
    }
    ok = True
    for task in a.tasks.split(","):
        project, artifacts = work / task / "project", work / task / "artifacts"
        artifacts.mkdir(parents=True, exist_ok=True)
        if not (artifacts / "models").exists():
            (artifacts / "models").symlink_to(REPO / "artifacts" / "models", target_is_directory=True)
        data = task_data(task, a.task_prompts, a.general_prompts, a.eval_items)
        files = write_project(project, task, data, a.steps, a.eval_items, a.seed)
        arms = {}
        for arm in a.arms.split(","):
            arms[arm] = run_arm(project, artifacts, files[arm], task, arm, catalog)
            print(json.dumps({"task": task, **arms[arm]}, default=str), file=sys.stderr, flush=True)
        v = verdict(arms)
        ok = ok and v["met"]
        report["tasks"][task] = {
            "train_prompts": len(data["train"]) + len(data["general_train"]),
            "arms": arms,
            "goal": v,
        }
    report["wall_s"] = time.perf_counter() - t_all
    report["load_average_1m"] = {"start": load0[0], "end": os.getloadavg()[0]}
    print(json.dumps(report, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
