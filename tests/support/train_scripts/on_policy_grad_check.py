"""Run under ``torchrun --nproc-per-node 2``: the first on-policy step of the sharded trainer vs one process.

Every rank samples its share of round 1 with the student under FSDP2 (ranks finish their samples at different
decoding steps: they keep stepping together), the in-process teacher scores them, and the step's loss and
gradients are computed (exact global normalization). Global rank 0 gathers both ranks' samples of that step,
builds the unsharded student with the same seed and adapter values, computes the generalized JSD over all of
them in one batch (sum / global count) and its gradients. Everything lands in one ``torch.save`` file.
"""

import sys

import torch
import torch.distributed as dist

from tests.support.train_scripts.grad_check import perturb
from training import losses
from training import on_policy as opol
from training.config import TrainJob
from training.model import load_student
from training.recipes import OnPolicyDistillationRecipe
from training.sharded import full_tensor


def main(out_file: str, job_file: str) -> None:
    job = TrainJob.read(job_file)
    t = OnPolicyDistillationRecipe(job)
    t.setup()
    perturb(t.named_trainable)
    batches, counts, _ = t.prepare_on_policy(0)
    res = t.accumulate_on_policy(batches, counts)
    grads = {n: full_tensor(p.grad.detach()).clone() for n, p in t.named_trainable}
    per_step = job.training.micro_batch_size * job.training.gradient_accumulation_steps
    mine = [vars(s) for s in t.rounds[0][:per_step]]
    everyone: list = [None] * t.world
    dist.all_gather_object(
        everyone,
        {"samples": mine, "round_samples": len(t.rounds[0]), "lengths": [len(s.completion_ids) for s in t.rounds[0]]},
    )
    acc = t._round_acc[0]
    if t.rank == 0:
        torch.manual_seed(job.training.seed)
        ref = load_student(
            job.base_model_path,
            job.student,
            torch.device("cpu"),
            attn_implementation=t.attn_implementation,
            compute_dtype=t.precision.dtype,
        )
        perturb([(n, p) for n, p in ref.named_parameters() if p.requires_grad], collective=False)
        ref.train()
        samples = [opol.ScoredSample(**s) for e in everyone for s in e["samples"]]
        b = opol.batch(samples, t.pad_id, job.training.max_seq_len)
        logits = ref(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False).logits  # packed
        jsd, n = losses.generalized_jsd_sum(
            logits,
            b["labels"],
            b[losses.TEACHER_IDS],
            b[losses.TEACHER_LOGPROBS],
            job.training.distillation.on_policy.beta,
        )
        (jsd / n).backward()
        torch.save(
            {
                "loss": res.loss,
                "kl_tokens": counts[0],
                "grads": grads,
                "reference_loss": float(jsd / n),
                "reference_tokens": n,
                "world": t.world,
                "per_rank": everyone,
                "decode_steps": acc.decode_steps,
                "reference_grads": {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.requires_grad},
            },
            out_file,
        )
    t.cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:])
