"""Run under ``torchrun --nproc-per-node N``: the first step's loss and LoRA gradients, and the trainer's report of its
fused cross-entropy, for each ``path:job.json`` given.

``path`` is ``fused`` (``LoraFinetuneRecipe.fused_loss = True``: the cross-entropy from the hidden states and the LM
head's weight, ``training.kernels.linear_ce``) or ``logits`` (the head + plain loss). The LoRA matrices get the same
random values on every run (``grad_check.perturb``: PEFT starts B at zero), the trainer prepares and accumulates step 0
(exact global-token normalization), and global rank 0 saves the full gradients, the loss and ``fused_ce.report()``
(the micro-batches whose loss ran fused, and those that gathered a sharded head) in one ``torch.save`` file.
"""

import sys

import torch
import torch.distributed as dist
from grad_check import perturb

from training.config import TrainJob
from training.recipes import LoraFinetuneRecipe
from training.sharded import full_tensor


def main(out_file: str, *runs: str) -> None:
    results = {}
    for run in runs:
        path, job_file = run.split(":", 1)
        LoraFinetuneRecipe.fused_loss = path == "fused"
        t = LoraFinetuneRecipe(TrainJob.read(job_file))
        t.setup()
        perturb(t.named_trainable)
        batches, counts, _ = t.prepare(0)
        res = t.accumulate(batches, counts)
        grads = {n: full_tensor(p.grad.detach()).clone() for n, p in t.named_trainable}
        entry = {
            "loss": res.loss,
            "world": t.world,
            "sharded": t.mesh is not None,
            "fused": t.fused_ce.report() if t.fused_ce is not None else None,
            "micro_batches": len(batches),
            "grads": grads,
        }
        if t.rank == 0:
            results[run] = entry
        t.report.close()
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
