"""Helpers for the trainer's tests and benchmarks: cipher datasets, jobs, torchrun processes."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support import REPO_ROOT


def demo_spec():
    from campaigns.spec import CampaignSpec

    return CampaignSpec.model_validate(yaml.safe_load((REPO_ROOT / "campaigns" / "demo.yaml").read_text()))


def write_rows(
    out_dir: Path,
    tokenizer_dir: Path,
    pairs: list[tuple[str, str]],
    masked: set[int] = frozenset(),
    max_seq_len: int = 64,
    padding: str = "longest",
) -> Path:
    """A tokenized dataset in the tokenized_dataset stage's layout, written directly (independent of how
    dataprep builds one): ``<bos> prompt completion <eos>``, labels on the completion and EOS; rows in
    ``masked`` carry no loss token. ``padding`` is the collation the rows ask for (``longest``: classic
    padded batches with an attention mask, as the reference computations in these tests expect)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from campaign_orchestrator.dataset.tokenize import tokenizer_hash

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cols: dict[str, list] = {
        k: [] for k in ("input_ids", "labels", "position_ids", "num_tokens", "num_loss_tokens", "example_ids")
    }
    for i, (prompt, completion) in enumerate(pairs):
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = [tok.bos_token_id] + p_ids + c_ids
        labels = [-100] * (1 + len(p_ids)) + c_ids
        if i in masked:
            labels = [-100] * len(ids)
        if len(ids) > max_seq_len:
            raise ValueError(f"pair {i} is {len(ids)} tokens, over {max_seq_len}")
        cols["input_ids"].append(ids)
        cols["labels"].append(labels)
        cols["position_ids"].append(list(range(len(ids))))
        cols["num_tokens"].append(len(ids))
        cols["num_loss_tokens"].append(sum(x != -100 for x in labels))
        cols["example_ids"].append([f"r{i}"])
    meta = {
        "campaign.tokenizer_hash": tokenizer_hash(tokenizer_dir),
        "campaign.max_seq_len": str(max_seq_len),
        "campaign.padding": padding,
        "campaign.packing": "none",
        "campaign.dataset_key": "test",
        "campaign.split_name": "train",
        "campaign.template": "plain: <bos> prompt completion <eos>",
    }
    table = pa.table(
        {
            k: (
                pa.array(v, pa.list_(pa.int32()))
                if k in ("input_ids", "labels", "position_ids")
                else pa.array(v, pa.list_(pa.string()))
                if k == "example_ids"
                else pa.array(v, pa.int32())
            )
            for k, v in cols.items()
        }
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata(meta), out_dir / "data-00000.parquet")
    return out_dir


def write_cipher_dataset(
    out_dir: Path,
    tokenizer_dir: Path,
    n: int,
    seed: int = 0,
    masked_rows: int = 0,
    long_every: int = 0,
    padding: str = "longest",
) -> Path:
    """A tokenized dataset of ``n`` cipher pairs (the teacher's answers, known by construction).

    ``masked_rows`` extra rows have no loss token at all; ``long_every`` > 0 makes every k-th
    completion many words long, so micro-batches (and ranks) hold very uneven loss-token counts;
    ``padding``: the collation the rows ask for (``free``: a micro-batch is one row of its examples
    back to back, as the tokenized_dataset stage builds them).
    """
    from campaign_orchestrator.demo import cipher

    rng = random.Random(seed)
    gen = cipher.pairs(rng, cipher.CIPHER)
    pairs = []
    for i in range(n):
        p, c = next(gen)
        if long_every and i % long_every == 0:
            c = c + "".join(" " + cipher.encode(cipher.random_word(rng)) for _ in range(4))
        pairs.append((p, c))
    pairs += pairs[:masked_rows]
    return write_rows(out_dir, tokenizer_dir, pairs, masked=set(range(n, n + masked_rows)), padding=padding)


def make_job(out: Path, base: Path, dataset: Path, student: dict | None = None, **training):
    """A TrainJob from the demo campaign's student and training sections, with overrides."""
    from campaigns.spec import StudentSpec, TrainingSpec
    from training.config import TrainJob

    spec = demo_spec()
    st = StudentSpec.model_validate(spec.student.model_dump() | (student or {}))
    tr_fields = spec.training.model_dump() | {"log_every": 5}
    for k, v in training.items():
        if isinstance(v, dict) and isinstance(tr_fields.get(k), dict):
            tr_fields[k] = tr_fields[k] | v
        else:
            tr_fields[k] = v
    return TrainJob(
        campaign="test",
        base_model_path=str(base),
        dataset_path=str(dataset),
        output_dir=str(out),
        student=st,
        training=TrainingSpec.model_validate(tr_fields),
    )


def child_env(threads: int = 1) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


def start_nodes(cmds: list[list[str]], logdir: Path, env: dict | None = None) -> list[subprocess.Popen]:
    """One process group per node command, output to ``logdir/node-<i>.log``."""
    logdir.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env or child_env(),
            stdout=(logdir / f"node-{i}.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for i, cmd in enumerate(cmds)
    ]


def node_logs(logdir: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(logdir.glob("node-*.log"))
    )


PYTHON = sys.executable


def write_pairs_dataset(
    out_dir: Path, tokenizer_dir: Path, pairs: list[tuple[str, str]], masked: set[int] = frozenset()
) -> Path:
    return write_rows(out_dir, tokenizer_dir, pairs, masked=masked)


def add_teacher_topk(ds_dir: Path, teacher_dir: Path, k: int = 4) -> Path:
    """Give a tokenized cipher dataset the teacher's top-k log-probabilities, the way a generation would
    carry them: one ``{token_id, logprob}`` list per completion token, aligned onto the rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from training.losses import align_top_logprobs

    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    path = ds_dir / "data-00000.parquet"
    t = pq.read_table(path)
    ids_col, lps_col = [], []
    for row in t.to_pylist():
        x = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(teacher(input_ids=x).logits[0].float(), -1)
        positions = [i for i, lab in enumerate(row["labels"]) if lab != -100]
        top = []
        for pos in positions:  # the distribution that produced token `pos` comes from position pos - 1
            v, i = lp[pos - 1].topk(k)
            top.append([{"token_id": int(a), "logprob": float(b)} for a, b in zip(i, v, strict=False)])
        ids, lps = align_top_logprobs(row["labels"], top, generated_ids=[row["labels"][p] for p in positions])
        ids_col.append(ids)
        lps_col.append(lps)
    t = t.append_column("teacher_topk_ids", pa.array(ids_col, pa.list_(pa.list_(pa.int32()))))
    t = t.append_column("teacher_topk_logprobs", pa.array(lps_col, pa.list_(pa.list_(pa.float32()))))
    pq.write_table(t, path)
    return ds_dir
