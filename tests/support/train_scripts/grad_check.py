"""Run under ``torchrun --nproc-per-node 2``: gradients and forwards of the sharded trainer vs one process.

For every job file given, the trainer is set up (FSDP2 with that job's topology), the first
optimizer step's gradients are accumulated (world 2 × accumulation 2, exact global-token
normalization) and gathered as full tensors. Global rank 0 also builds an unsharded model with
the same seed and computes Hugging Face's own mean loss over the whole global batch in one
process, and compares forwards (twice, eval and train mode) of the sharded and unsharded models.
Everything lands in one ``torch.save`` file for the test to judge.
"""

import sys

import torch
import torch.distributed as dist
from example_losses import per_example  # this folder: the script's own path

from training import data as tdata
from training.config import TrainJob
from training.model import load_student
from training.recipes import LoraFinetuneRecipe
from training.sharded import full_tensor


def reference(job: TrainJob, trainer: LoraFinetuneRecipe) -> dict:
    torch.manual_seed(job.training.seed)
    ref = load_student(
        job.base_model_path,
        job.student,
        torch.device("cpu"),
        activation_checkpointing=job.training.activation_checkpointing,
        attn_implementation=trainer.attn_implementation,
        compute_dtype=trainer.precision.dtype,
    )
    perturb([(n, p) for n, p in ref.named_parameters() if p.requires_grad], collective=False)
    ref.train()
    plan = trainer.plan
    rows = [i for r in range(plan.world) for micro in plan.step_rows(0, r) for i in micro]
    batch = tdata.collate(trainer.rows, sorted(rows), trainer.pad_id)
    out = ref(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        labels=batch["labels"],
    )
    loss = out.loss if job.training.loss_normalization == "token" else example_mean(out.logits, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    return {"loss": float(loss), "grads": grads, "rows": sorted(rows), "model": ref}


def example_mean(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """``loss_normalization: example`` written out: each example's mean next-token loss, the examples averaged."""
    rows = range(logits.size(0))
    parts = [e for r in rows for e in per_example(logits[r], batch["labels"][r], batch["position_ids"][r])]
    return torch.stack([e.mean() for e in parts]).mean()


def forwards(trainer: LoraFinetuneRecipe, ref_model) -> dict:
    batch = tdata.collate(trainer.rows, [0, 1, 2, 3], trainer.pad_id)
    inputs = {k: v for k, v in batch.items() if k not in tdata.NON_MODEL_KEYS}
    diffs = {}
    for mode in ("eval", "eval", "train", "eval"):
        trainer.model.train(mode == "train")
        if ref_model is not None:
            ref_model.train(mode == "train")
        with torch.no_grad():
            a = trainer.model(**inputs).logits.float()
            b = ref_model(**inputs).logits.float() if ref_model is not None else a
        diffs.setdefault(mode, []).append(float((a - b).abs().max()))
    trainer.model.train()
    return diffs


def perturb(named, seed: int = 123, collective: bool = True) -> None:
    """Give every LoRA matrix random values (PEFT starts B at zero, which would make A's gradient zero)."""
    from training.sharded import load_full_into

    g = torch.Generator().manual_seed(seed)
    for _, p in sorted(named, key=lambda x: x[0]):
        v = torch.randn(p.shape, generator=g) * 0.05
        if collective:
            load_full_into(p, v)
        else:
            with torch.no_grad():
                p.copy_(v)


def main(out_file: str, *job_files: str) -> None:
    results = {}
    for jf in job_files:
        job = TrainJob.read(jf)
        t = LoraFinetuneRecipe(job)
        t.setup()
        perturb(t.named_trainable)
        batches, counts, _ = t.prepare(0)
        local_tokens = [tdata.loss_token_count(b) for b in batches]
        res = t.accumulate(batches, counts)
        grads = {n: full_tensor(p.grad.detach()).clone() for n, p in t.named_trainable}
        per_rank: list = [None] * t.world
        dist.all_gather_object(per_rank, local_tokens)
        entry = {
            "loss": res.loss,
            "global_tokens": counts[0],
            "tokens_per_rank_micro": per_rank,
            "sharding": job.training.sharding,
            "mesh": str(t.mesh),
            "grads": grads,
            "compute_dtype": t.precision.dtype,
        }
        t.optimizer.zero_grad(set_to_none=True)
        ref = reference(job, t) if t.rank == 0 else None
        # Forwards are collective for the sharded model: every rank runs them, rank 0 compares.
        entry["forward_max_abs_diff"] = forwards(t, ref["model"] if ref else None)
        if t.rank == 0:
            entry["reference_loss"], entry["reference_grads"], entry["rows"] = ref["loss"], ref["grads"], ref["rows"]
            results[jf] = entry
        t.report.close()
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
