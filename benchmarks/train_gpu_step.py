"""One GPU, one run (< 8 minutes): this trainer's bf16 LoRA, QLoRA and FSDP2 steps on a ~1B model, and the vLLM teacher.

Builds a TinyLlama-1.1B-shaped ``LlamaConfig`` model (random weights, bf16, saved like a checkpoint)
and a dataset of random token rows (labels on the second half), then runs ``training.trainer.run`` in
this process, a few steps each:

* ``lora``: bf16 base, LoRA r16 on every linear layer (a world of one: no FSDP wrapping);
* ``qlora_nf4``: the same on a 4-bit NF4 base (bf16 compute), when bitsandbytes runs 4-bit here;
* ``fsdp2_lora``: the bf16 LoRA run through FSDP2 (``fully_shard``, the trainer's own sharding,
  ``LoraTrainer.shard_single_process``) with the NCCL process group of the trainer, on one GPU;

each with real tokens/s after the first (warm-up) step, MFU against this GPU's measured bf16 matmul
peak (8192², same run) and peak allocated memory. Then, when ``vllm`` is importable, the ``vllm``
teacher backend (``campaign_orchestrator.generation.backends.VLLMBackend``) generates for the demo
teacher (``@demo/teacher``; built into a temporary artifact root when absent): tokens/s, rows/s and
exact match against the references.

Without a CUDA device it prints ``{"skipped": ...}`` and exits 0 (so ``make bench`` passes on CPU
machines). ``--tiny`` runs a small config on whatever device there is, in the dtype
``compute_dtype: auto`` picks there (fp32 on a CPU without native bf16), against that dtype's
measured peak; the test suite runs it on CPU (``tests/benchmarks/test_train_gpu_step.py``). On CPU,
peak memory is the process's peak RSS so far (monotone across the runs of one process).

    python benchmarks/train_gpu_step.py --out gpu.json            # on a GPU node
    python benchmarks/train_gpu_step.py --tiny --steps 3          # anywhere: checks the script

Exit status 1 when a section that should run fails (its error is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def matmul_peak_tflops(device, n: int) -> float:
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(10):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e12


def build(work: Path, shape: dict, seq: int, rows: int):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from campaign_orchestrator.dataset.tokenize import tokenizer_hash

    base = work / "base"
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
                                  pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    cfg = LlamaConfig(max_position_embeddings=seq, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(base))
    tok.save_pretrained(str(base))
    rng = np.random.default_rng(0)
    ids = [rng.integers(4, shape["vocab_size"], seq).tolist() for _ in range(rows)]
    labels = [[-100] * (seq // 2) + r[seq // 2:] for r in ids]
    table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())), "labels": pa.array(labels, pa.list_(pa.int32())),
                      "position_ids": pa.array([list(range(seq))] * rows, pa.list_(pa.int32())),
                      "num_tokens": pa.array([seq] * rows, pa.int32()),
                      "num_loss_tokens": pa.array([seq - seq // 2] * rows, pa.int32()),
                      "example_ids": pa.array([[f"r{i}"] for i in range(rows)], pa.list_(pa.string()))})
    (work / "ds").mkdir()
    meta = {"campaign.tokenizer_hash": tokenizer_hash(base), "campaign.max_seq_len": str(seq),
            "campaign.padding": "longest", "campaign.dataset_key": "gpu-bench", "campaign.split_name": "train"}
    pq.write_table(table.replace_schema_metadata(meta), work / "ds" / "data-00000.parquet")
    return base, work / "ds"


def run_one(work: Path, base: Path, ds: Path, name: str, qlora: bool, fsdp: bool, micro: int, steps: int, seq: int,
            dtype: str) -> dict:
    import torch

    from tests.support.train_support import make_job
    from training import trainer

    student = {"quantization": {"load_in_4bit": qlora, "compute_dtype": dtype},
               "lora": {"r": 16, "alpha": 32, "dropout": 0.0,
                        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}}
    out = work / name
    job = make_job(out, base, ds, student=student, max_steps=steps, micro_batch_size=micro, max_seq_len=seq,
                   eval_rows=0, log_every=1, warmup_steps=1, checkpoint={"every_steps": None, "every_minutes": None})
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.LoraTrainer.shard_single_process = fsdp
    real_shard, sharded = trainer.shard, []

    def counting_shard(model, mesh, compute_dtype):  # evidence that the run went through fully_shard
        sharded.append(str(mesh.device_type))
        return real_shard(model, mesh, compute_dtype)

    trainer.shard = counting_shard
    try:
        summary = trainer.run(job.write(work / f"{out.name}.json"))
    finally:
        trainer.LoraTrainer.shard_single_process = False
        trainer.shard = real_shard
    import pyarrow.parquet as pq

    m = pq.read_table(out / "metrics.parquet").to_pylist()[1:]  # the first step warms kernels up
    tokens, secs = sum(r["tokens"] for r in m), sum(r["step_s"] for r in m)
    return {"tokens_per_s": tokens / secs, "steps_timed": len(m), "peak_memory_mb": summary["peak_memory_mb"],
            "trainable": summary["trainable_parameters"], "final_loss": summary["final_loss"],
            "attention": summary["attn_implementation"], "world": summary.get("world_size", 1),
            "fsdp2_mesh": sharded[0] if sharded else None}


def bnb_usable(device) -> str | None:
    """None when bitsandbytes can run 4-bit here, else why not."""
    try:
        import bitsandbytes as bnb  # noqa: F401
    except ImportError as e:
        return f"bitsandbytes not importable: {e}"
    if device.type == "cuda":
        try:
            import torch

            bnb.functional.quantize_4bit(torch.randn(64, 64, device=device, dtype=torch.bfloat16), quant_type="nf4")
        except Exception as e:  # noqa: BLE001 - a CPU-only build raises on a CUDA tensor
            return f"bitsandbytes has no CUDA support here: {e}"
    return None


def vllm_teacher(artifacts: Path, prompts_n: int, work: Path) -> dict:
    """The vllm teacher backend on the demo teacher: generation throughput and exact match."""
    from campaign_orchestrator.demo.recipe import resolve
    from campaign_orchestrator.generation.backends import VLLMBackend
    from campaign_orchestrator.generation.blobstore import LocalStore
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.requests import Sampling, namespace
    from campaign_orchestrator.generation.runner import run_generation
    from teacher_common import prompts

    model_dir = resolve("@demo/teacher", artifacts)
    built = False
    if not (model_dir / "config.json").exists():
        from campaign_orchestrator.demo.build import build_demo_models

        root = work / "artifacts"
        build_demo_models(root, log=lambda _m: None, moe=False)
        model_dir, built = resolve("@demo/teacher", root), True
    rows = prompts(prompts_n)
    backend = VLLMBackend(str(model_dir), "bench:vllm", engine_args={"gpu_memory_utilization": 0.3,
                                                                      "enforce_eager": False})
    s = Sampling(max_new_tokens=16)
    t0 = time.perf_counter()
    res = run_generation(rows, backend, s, GenerationCache(LocalStore(str(work / "gen")), namespace(backend.identity, s),
                                                           str(work / "spool")))
    wall = time.perf_counter() - t0
    st = res.stats
    correct = sum(r["completion"] == " " + p["reference"] for r, p in zip(res.rows, rows, strict=True))
    return {"prompts": prompts_n, "wall_s_with_engine_start": round(wall, 2), "generate_s": round(st.generate_s, 3),
            "completion_tokens": st.new_completion_tokens, "tokens_per_s": round(st.tokens_per_s, 1),
            "rows_per_s": round(st.rows_per_s, 1), "exact_match": round(correct / prompts_n, 4),
            "demo_teacher_built_in_run": built}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small config on any device (checks the script)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vllm-prompts", type=int, default=2048)
    ap.add_argument("--artifacts", type=Path, default=REPO / "artifacts", help="where @demo/teacher is looked up")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is the warm-up, left out of the timing)")
    import torch

    if not torch.cuda.is_available() and not args.tiny:
        return _emit({"benchmark": "train_gpu_step", "skipped": "no CUDA device on this machine"}, args.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES["tiny" if args.tiny else "1b"]
    seq = 64 if args.tiny else args.seq
    from train_throughput import flops_per_token

    if device.type == "cuda":
        dtype = "bfloat16"
        peak_flops = matmul_peak_tflops(device, 1024 if args.tiny else 8192) * 1e12
    else:
        from campaign_orchestrator.hardware import measure_cpu_peak, resolve_compute_dtype

        cpu = measure_cpu_peak()
        dtype = resolve_compute_dtype("auto", "cpu", cpu).dtype
        peak_flops = cpu.gflops(dtype) * 1e9
    t_start = time.perf_counter()
    results: dict = {}
    failed = []
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        work = Path(tmp)
        base, ds = build(work, shape, seq, rows=args.micro * (args.steps + 2))
        why_not_4bit = bnb_usable(device)
        sections = [("lora", False, False), ("qlora_nf4", True, False), ("fsdp2_lora", False, True)]
        for name, qlora, fsdp in sections:
            if qlora and why_not_4bit:
                results[name] = {"skipped": why_not_4bit}
                continue
            try:
                r = run_one(work, base, ds, name, qlora, fsdp, args.micro, args.steps, seq, dtype)
            except Exception as e:  # noqa: BLE001 - reported in the JSON; the exit status says it failed
                results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                failed.append(name)
                continue
            r["mfu"] = flops_per_token(base, r["trainable"], seq) * r["tokens_per_s"] / peak_flops
            results[name] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
        try:
            import vllm  # noqa: F401

            have_vllm = device.type == "cuda"
            why = "vllm needs a CUDA device" if not have_vllm else None
        except ImportError:
            have_vllm, why = False, "vllm is not importable here (pip install '.[vllm]' on the GPU image)"
        if have_vllm:
            try:
                results["vllm_teacher"] = vllm_teacher(args.artifacts, args.vllm_prompts, work)
            except Exception as e:  # noqa: BLE001
                results["vllm_teacher"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                failed.append("vllm_teacher")
        else:
            results["vllm_teacher"] = {"skipped": why}
    return _emit({
        "benchmark": "train_gpu_step", "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": "Llama " + ("tiny" if args.tiny else "1.1B (TinyLlama shape)"), "compute_dtype": dtype,
        "seq": seq, "micro_batch": args.micro, "steps": args.steps,
        "matmul_peak_tflops": {"dtype": dtype, "value": round(peak_flops / 1e12, 4),
                               "source": "8192² matmul, this run" if device.type == "cuda"
                               else "campaign_orchestrator.hardware.measure_cpu_peak"},
        "results": results, "failed": failed, "wall_s": round(time.perf_counter() - t_start, 1),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
    }, args.out, 1 if failed else 0)


def _emit(result: dict, out: Path | None, rc: int = 0) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
