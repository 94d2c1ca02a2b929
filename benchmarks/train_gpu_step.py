"""One GPU: training throughput, MFU and peak memory of this trainer on a ~1B model built from a config.

Builds a TinyLlama-1.1B-shaped ``LlamaConfig`` model (random weights, bf16, saved like a checkpoint),
a dataset of random token rows (labels on the second half), and runs ``training.trainer.run`` in this
process for a few steps twice: bf16 LoRA, then QLoRA (4-bit NF4) when bitsandbytes has a CUDA
build. Reports real tokens/s (after a warm-up step), MFU against this GPU's measured bf16 matmul
peak (8192², same run) and peak allocated memory, as JSON. Without a CUDA device it prints
``{"skipped": ...}`` and exits 0 (so ``make bench`` passes on CPU machines); ``--tiny`` runs a
small config on whatever device there is, to check the script itself.
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


def run_one(work: Path, base: Path, ds: Path, qlora: bool, micro: int, steps: int, seq: int) -> dict:
    import torch

    from tests.support.train_support import make_job
    from training.trainer import run

    student = {"quantization": {"load_in_4bit": qlora, "compute_dtype": "bfloat16"},
               "lora": {"r": 16, "alpha": 32, "dropout": 0.0,
                        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}}
    out = work / ("qlora" if qlora else "lora")
    job = make_job(out, base, ds, student=student, max_steps=steps, micro_batch_size=micro, max_seq_len=seq,
                   eval_rows=0, log_every=1, warmup_steps=1, checkpoint={"every_steps": None, "every_minutes": None})
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    summary = run(job.write(work / f"{out.name}.json"))
    import pyarrow.parquet as pq

    m = pq.read_table(out / "metrics.parquet").to_pylist()[1:]  # the first step warms kernels up
    tokens, secs = sum(r["tokens"] for r in m), sum(r["step_s"] for r in m)
    return {"tokens_per_s": tokens / secs, "peak_memory_mb": summary["peak_memory_mb"],
            "trainable": summary["trainable_parameters"], "final_loss": summary["final_loss"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small config on any device (checks the script)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.tiny:
        print(json.dumps({"benchmark": "train_gpu_step", "skipped": "no CUDA device on this machine"}))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES["tiny" if args.tiny else "1b"]
    seq = 64 if args.tiny else args.seq
    from train_throughput import flops_per_token

    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        work = Path(tmp)
        base, ds = build(work, shape, seq, rows=args.micro * (args.steps + 2))
        peak = matmul_peak_tflops(device, 1024 if args.tiny else 8192)
        results = {}
        modes = [False]
        try:
            import bitsandbytes  # noqa: F401

            modes.append(True)
        except ImportError:
            pass
        for qlora in modes:
            r = run_one(work, base, ds, qlora, args.micro, args.steps, seq)
            r["mfu"] = flops_per_token(base, r["trainable"], seq) * r["tokens_per_s"] / (peak * 1e12)
            results["qlora_nf4" if qlora else "lora_bf16"] = {k: round(v, 4) if isinstance(v, float) else v
                                                               for k, v in r.items()}
    print(json.dumps({"benchmark": "train_gpu_step", "device": torch.cuda.get_device_name() if device.type == "cuda"
                      else "cpu", "model": "Llama " + ("tiny" if args.tiny else "1.1B (TinyLlama shape)"),
                      "seq": seq, "micro_batch": args.micro, "matmul_peak_bf16_tflops": round(peak, 2),
                      "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
