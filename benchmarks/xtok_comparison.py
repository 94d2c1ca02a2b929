"""Cross-tokenizer logit KD against sequence KD on the demo, side by side (issue 45).

Two campaigns that differ only in the loss run end to end (`campaign run`, each its own Dagster run, one
artifact root so the second arm reads the teacher stage from the cache):

- ``logits``: ``campaigns/demo_xtok.yaml`` as shipped: the byte-level BPE teacher (``@demo/teacher_bpe``) keeps
  its top-8 per token, placed on the character-level student's tokens by byte offsets; exact top-k KL where a
  teacher token is one student character, the vocabulary-free ULD term elsewhere, mixed with cross-entropy
  (``kl_weight`` 0.5);
- ``sequence``: the same campaign with ``training.distillation.loss: sequence`` (cross-entropy on the teacher's
  text). It keeps ``teacher.sampling.logprobs`` so both arms train on the same teacher generations (one teacher
  stage, its answers byte for byte the same: greedy).

Same data, same steps (``--steps``, default the shipped 150), same seeds, same evaluation items. Per arm: the
gate's verdict and the cipher suite's score with its paired 95% interval against the base, the format suite
(advisory), steps to reach the gate (the first checkpoint, every ``--every`` steps, whose held-out cipher exact
match reaches the gate's floor ``min_score``; the demo has no general suite, so the regression part of the gate
is the cipher suite's own against the base, ~0), teacher tokens (prompt + completion, each arm charged in full even
when the second reads the first one's cache), what those tokens would cost at an API teacher's prices
(``api-open-70b``), the ledger's spend, the training time, and the alignment shares of the logit arm (exact /
ULD / none) from the trainer's summary. Also the second teacher's build time (``--build``: rebuilt here, timed).

    PYTHONPATH=. .venv/bin/python benchmarks/xtok_comparison.py --out benchmarks/data/xtok_comparison_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ARMS = ("logits", "sequence")
API_PRICE_KEY = "api-open-70b"


def campaign_yaml(arm: str, steps: int, every: int, seed: int) -> dict:
    c = yaml.safe_load((REPO / "campaigns" / "demo_xtok.yaml").read_text())
    c["name"] = f"xtok_cmp_{arm}_s{seed}"
    c["description"] = f"benchmarks/xtok_comparison.py: {arm}, seed {seed}"
    tr = c["training"]
    tr["max_steps"], tr["seed"] = steps, seed
    tr["checkpoint"] = {"every_steps": every, "every_minutes": None, "keep_last": steps // every + 1}
    if arm == "sequence":
        tr["distillation"] = {"loss": "sequence"}
    c.pop("schedule", None)
    return c


def write_project(root: Path, arms: list[str], steps: int, every: int, seeds: list[int]) -> dict[tuple, Path]:
    camp = root / "campaigns"
    (camp / "data" / "demo").mkdir(parents=True, exist_ok=True)
    for f in (REPO / "campaigns" / "data" / "demo").glob("*.jsonl"):
        shutil.copy2(f, camp / "data" / "demo" / f.name)
    (camp / "pricing").mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "campaigns" / "pricing" / "catalog.yaml", camp / "pricing" / "catalog.yaml")
    files = {}
    for seed in seeds:
        for arm in arms:
            c = campaign_yaml(arm, steps, every, seed)
            f = camp / f"{c['name']}.yaml"
            f.write_text(yaml.safe_dump(c, sort_keys=False))
            files[(arm, seed)] = f
    return files


def _manifest(artifacts: Path, campaign: str, stage: str) -> dict | None:
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


def steps_to_gate(artifacts: Path, campaign: str, spec: dict, floor: float) -> dict:
    """Held-out cipher exact match of every kept checkpoint (the base + that step's adapter, greedy, as the
    evaluation stage loads the candidate) and the first step that reaches ``floor``."""
    import pyarrow.parquet as pq

    from campaign_orchestrator.demo.recipe import resolve
    from campaign_orchestrator.generation.local import LocalModel
    from evaluation.scorers import exact_match

    prompts = _manifest(artifacts, campaign, "prompts")
    held = pq.read_table(prompts["heldout_path"]).to_pylist()
    adapter = _manifest(artifacts, campaign, "student_adapter")
    ckpts = sorted(Path(adapter["adapter_path"]).parent.glob("checkpoints/step-*"))
    base = resolve(spec["student"]["base_model"], artifacts)
    scores = {}
    for c in ckpts:
        step = int(c.name.split("-")[1])
        g = LocalModel.from_path(base, c, spec["student"]["quantization"]["load_in_4bit"], "auto", batch_size=64)
        outs = g.generate([r["prompt"] for r in held], 16)
        scores[step] = sum(exact_match(o.text, r["reference"]) for o, r in zip(outs, held, strict=True)) / len(held)
    first = next((s for s in sorted(scores) if scores[s] >= floor), None)
    return {
        "every": sorted(scores),
        "exact_match_by_step": scores,
        "first_step_at_floor": first,
        "floor": floor,
        "items": len(held),
    }


def run_arm(project: Path, artifacts: Path, yaml_file: Path, arm: str, catalog) -> dict:
    campaign = yaml_file.stem
    env = os.environ | {"CAMPAIGN_PROJECT_DIR": str(project), "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "campaign_app.cli",
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
    ev = _manifest(artifacts, campaign, "evaluation")
    if ev is None:
        return {
            "arm": arm,
            "error": f"exit {p.returncode} without an evaluation: {(p.stdout + p.stderr)[-2000:]}",
            "wall_s": wall,
        }
    gate = json.loads(Path(ev["gate_path"]).read_text())
    from campaign_orchestrator.costs.ledger import Ledger

    by_kind: dict[str, float] = {}
    for line in Ledger(artifacts / "cost_ledger.duckdb").lines(campaign):
        by_kind[line["kind"]] = by_kind.get(line["kind"], 0.0) + float(line["usd"])
    in_usd, out_usd = catalog.get(API_PRICE_KEY).token_usd()
    tg = _manifest(artifacts, campaign, "teacher_generations") or {}
    prompt_t, completion_t = int(tg.get("prompt_tokens", 0)), int(tg.get("completion_tokens", 0))
    teacher_host_usd = sum(float(x["usd"]) for x in tg.get("cost_lines") or [])
    summary = (_manifest(artifacts, campaign, "student_adapter") or {}).get("summary") or {}
    tok = _manifest(artifacts, campaign, "tokenized_dataset") or {}
    spec = yaml.safe_load(yaml_file.read_text())
    spent = sum(by_kind.values())
    return {
        "arm": arm,
        "campaign": campaign,
        "exit_code": p.returncode,
        "verdict": gate["verdict"],
        "cipher": _suite(gate, "cipher"),
        "format": _suite(gate, "format"),
        "general": "the demo has no general suite",
        "steps": summary.get("steps"),
        "steps_to_gate": steps_to_gate(artifacts, campaign, spec, float(spec["evaluation"]["gate"]["min_score"])),
        "teacher_tokens": prompt_t + completion_t,
        "teacher_prompt_tokens": prompt_t,
        "teacher_completion_tokens": completion_t,
        "teacher_from_cache": bool(tg.get("cached_rows") == tg.get("rows")) if "cached_rows" in tg else None,
        "teacher_usd_at_api_price": prompt_t / 1e6 * in_usd + completion_t / 1e6 * out_usd,
        "api_price": f"{API_PRICE_KEY}: ${in_usd}/M in, ${out_usd}/M out",
        "ledger_usd_this_run": spent,
        "ledger_usd_by_kind": by_kind,
        "usd_with_its_teacher_stage": spent - by_kind.get("teacher", 0.0) + teacher_host_usd,
        "train_s": summary.get("train_seconds"),
        "first_loss": summary.get("first_loss"),
        "final_loss": summary.get("final_loss"),
        "eval_loss": summary.get("eval_loss"),
        "distillation_alignment": summary.get("distillation_alignment"),
        "dataset_teacher_topk": tok.get("teacher_topk"),
        "wall_s": wall,
    }


def summarize(runs: list[dict]) -> dict:
    """An arm over its seeds: verdicts, the cipher score, steps to the gate's floor (mean and each), the held-out
    exact match by step averaged over seeds, teacher tokens and cost, training time."""
    ok = [r for r in runs if "verdict" in r]
    if not ok:
        return {"error": "no run finished"}

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    steps = [r["steps_to_gate"]["first_step_at_floor"] for r in ok]
    by_step: dict[int, list[float]] = {}
    for r in ok:
        for s, v in r["steps_to_gate"]["exact_match_by_step"].items():
            by_step.setdefault(int(s), []).append(v)
    return {
        "runs": len(ok),
        "verdicts": [r["verdict"] for r in ok],
        "cipher_candidate_mean": mean([r["cipher"]["candidate"] for r in ok]),
        "cipher_delta_lo_min": min(r["cipher"]["delta_lo"] for r in ok),
        "format_candidate_mean": mean([r["format"]["candidate"] for r in ok]),
        "general": "the demo has no general suite",
        "steps_to_gate": steps,
        "steps_to_gate_mean": mean(steps),
        "exact_match_by_step_mean": {s: sum(v) / len(v) for s, v in sorted(by_step.items())},
        "teacher_tokens": ok[0]["teacher_tokens"],
        "teacher_usd_at_api_price": ok[0]["teacher_usd_at_api_price"],
        "usd_with_its_teacher_stage_mean": mean([r["usd_with_its_teacher_stage"] for r in ok]),
        "train_s_mean": mean([r["train_s"] for r in ok]),
        "final_loss_mean": mean([r["final_loss"] for r in ok]),
        "distillation_alignment": ok[0]["distillation_alignment"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per arm (shipped: 150)")
    ap.add_argument("--every", type=int, default=5, help="checkpoint (and steps-to-gate evaluation) interval")
    ap.add_argument("--seeds", default="0,1,2", help="training seeds (LoRA init, data order), one run per arm each")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument(
        "--models-root",
        action="append",
        help="an artifact root holding built demo models, linked in (repeatable; default: $CAMPAIGN_TEST_MODELS_ROOT "
        "or ./artifacts); the byte-level BPE teacher is built (and timed) when none of them has it",
    )
    ap.add_argument("--workdir", help="keep the project and artifact root here (default: a temporary directory)")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    from campaign_orchestrator.costs.catalog import read_catalog

    catalog = read_catalog(REPO / "campaigns" / "pricing" / "catalog.yaml")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="xtok-cmp-"))
    project, artifacts = work / "project", work / "artifacts"
    (artifacts / "models").mkdir(parents=True, exist_ok=True)
    from campaign_orchestrator.demo.recipe import model_dirs, xtok_models_dir

    roots = a.models_root or [os.environ.get("CAMPAIGN_TEST_MODELS_ROOT", str(REPO / "artifacts"))]
    for root in roots:
        for src in model_dirs(root):
            dest = artifacts / "models" / src.name
            if (src / "_SUCCESS").exists() and not dest.exists():
                dest.symlink_to(src, target_is_directory=True)
    built_before = (xtok_models_dir(artifacts) / "_SUCCESS").exists()
    load0 = os.getloadavg()
    t_all = time.perf_counter()
    from campaign_orchestrator.demo.build import build_xtok_teacher

    build = build_xtok_teacher(artifacts, log=lambda m: print(m, file=sys.stderr, flush=True))
    seeds = [int(x) for x in a.seeds.split(",")]
    files = write_project(project, a.arms.split(","), a.steps, a.every, seeds)
    runs = []
    for (arm, seed), f in files.items():
        runs.append(run_arm(project, artifacts, f, arm, catalog) | {"seed": seed})
        print(json.dumps(runs[-1], default=str), file=sys.stderr, flush=True)
    # the teacher stage is paid once (the first run; the others read the generation cache): each run is charged it
    paid = max((r.get("ledger_usd_by_kind", {}).get("teacher", 0.0) for r in runs), default=0.0)
    for r in runs:
        if "ledger_usd_this_run" in r:
            r["usd_with_its_teacher_stage"] = (
                r["ledger_usd_this_run"] - r["ledger_usd_by_kind"].get("teacher", 0.0) + paid
            )
    arms = {arm: summarize([r for r in runs if r["arm"] == arm]) for arm in a.arms.split(",")}
    report = {
        "benchmark": "xtok_comparison",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "command": "benchmarks/xtok_comparison.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "runs_per_arm": len(seeds),
        "seeds": seeds,
        "teacher_bpe_build": build | {"built_in_this_run": not built_before},
        "arms": arms,
        "runs": runs,
        "wall_s": time.perf_counter() - t_all,
        "load_average_1m": {"start": load0[0], "end": os.getloadavg()[0]},
        "workdir": str(work),
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if all("verdict" in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
