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

Same data, same steps (``--steps``, default the shipped 150), same seed, same evaluation items. Per arm: the
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
    c["name"] = f"xtok_cmp_{arm}"
    c["description"] = f"benchmarks/xtok_comparison.py: {arm}"
    tr = c["training"]
    tr["max_steps"], tr["seed"] = steps, seed
    tr["checkpoint"] = {"every_steps": every, "every_minutes": None, "keep_last": steps // every + 1}
    if arm == "sequence":
        tr["distillation"] = {"loss": "sequence"}
    c.pop("schedule", None)
    return c


def write_project(root: Path, steps: int, every: int, seed: int) -> dict[str, Path]:
    camp = root / "campaigns"
    (camp / "data" / "demo").mkdir(parents=True, exist_ok=True)
    for f in (REPO / "campaigns" / "data" / "demo").glob("*.jsonl"):
        shutil.copy2(f, camp / "data" / "demo" / f.name)
    (camp / "pricing").mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "campaigns" / "pricing" / "catalog.yaml", camp / "pricing" / "catalog.yaml")
    files = {}
    for arm in ARMS:
        f = camp / f"xtok_cmp_{arm}.yaml"
        f.write_text(yaml.safe_dump(campaign_yaml(arm, steps, every, seed), sort_keys=False))
        files[arm] = f
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
    from campaign_orchestrator.generation.local import LocalGenerator
    from evaluation.scorers import exact_match

    prompts = _manifest(artifacts, campaign, "prompts")
    held = pq.read_table(prompts["heldout_path"]).to_pylist()
    adapter = _manifest(artifacts, campaign, "student_adapter")
    ckpts = sorted(Path(adapter["adapter_path"]).parent.glob("checkpoints/step-*"))
    base = resolve(spec["student"]["base_model"], artifacts)
    scores = {}
    for c in ckpts:
        step = int(c.name.split("-")[1])
        g = LocalGenerator.from_path(base, c, spec["student"]["quantization"]["load_in_4bit"], "auto", batch_size=64)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per arm (shipped: 150)")
    ap.add_argument("--every", type=int, default=10, help="checkpoint (and steps-to-gate evaluation) interval")
    ap.add_argument("--seed", type=int, default=0)
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
    files = write_project(project, a.steps, a.every, a.seed)
    arms = {}
    for arm in a.arms.split(","):
        arms[arm] = run_arm(project, artifacts, files[arm], arm, catalog)
        print(json.dumps(arms[arm], default=str), file=sys.stderr, flush=True)
    report = {
        "benchmark": "xtok_comparison",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "command": "benchmarks/xtok_comparison.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "runs_per_arm": 1,
        "seed": a.seed,
        "teacher_bpe_build": build | {"built_in_this_run": not built_before},
        "arms": arms,
        "wall_s": time.perf_counter() - t_all,
        "load_average_1m": {"start": load0[0], "end": os.getloadavg()[0]},
        "workdir": str(work),
    }
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if all("verdict" in x for x in arms.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
