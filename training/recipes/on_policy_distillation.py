"""On-policy distillation (GKD, Agarwal et al. 2024) as a recipe: the LoRA fine-tuning recipe whose steps are rounds.

In rounds, the student samples completions for training prompts with its current weights, the teacher scores every
sampled token (in process beside the student, or a server; ``training.on_policy``) and the loss is the generalized
JSD on those tokens. A fraction ``lambda`` of the steps after ``warmup_steps`` is on-policy; the others are the parent
recipe's off-policy steps on the teacher's generations (sequence KD). Rounds are logged, reported, checkpointed at
their end and resumable mid-round (each rank's scored samples are written to ``rounds/``).

Raises
  ``TrainingError`` as the parent recipe, and for a job without prompts or teacher, a mixture-of-experts student,
  a round the teacher scored nothing of, or a SIGTERM while a round samples (after writing a checkpoint).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from training import data, losses, on_policy
from training.config import TrainJob
from training.errors import TrainingError
from training.recipes.lora_finetune import LoraFinetuneRecipe, StepResult


class OnPolicyDistillationRecipe(LoraFinetuneRecipe):
    """``training.distillation.loss: on_policy``: student samples scored by the teacher, generalized JSD."""

    def __init__(self, job: TrainJob):
        super().__init__(job)
        self.op = self.spec.distillation.on_policy
        self.schedule: on_policy.Schedule | None = None
        self.scorer = None
        self.rounds: dict[int, list[on_policy.ScoredSample]] = {}  # this rank's scored samples, by round (current)
        self.round_stats: list[dict] = []  # every finished round (global figures)
        self._round_acc: dict[int, on_policy.RoundStats] = {}  # rounds in progress: reverse KL accumulated per step
        self._round_ready = 0.0  # when the current round's samples were ready (perf_counter)

    @property
    def compares_teacher_tokens(self) -> bool:
        return True

    # ------------------------------------------------------------------ setup
    def _setup_data(self) -> None:
        if self.job.on_policy is None:
            raise TrainingError(
                "training.distillation.loss is 'on_policy' but the job has no `on_policy` part "
                "(prompts and teacher); the student_adapter stage writes it"
            )
        from campaign_orchestrator.dataset.prompts import read_prompt_table

        self.prompts = read_prompt_table(self.job.on_policy.prompts_path)
        if not self.prompts:
            raise TrainingError(f"no training prompts in {self.job.on_policy.prompts_path}")
        if not self.job.dataset_path:  # teacher_generations: none: the prompts are the data
            return self._setup_prompts_only()
        super()._setup_data()

    def _setup_prompts_only(self) -> None:
        """A fully on-policy run without a teacher stage: no tokenized rows, no eval loss; the plan counts prompts."""
        self.rows = self.eval_data = None
        self.eval_source = "none (teacher_generations: none: no teacher text to measure the loss on)"
        n = len(self.prompts)
        self.plan = data.BatchPlan(
            n, self.spec.micro_batch_size, self.world, self.spec.gradient_accumulation_steps, self.spec.seed
        )
        if self.spec.max_steps is not None:
            self.total_steps = self.spec.max_steps
        else:
            self.total_steps = max(1, math.ceil(self.spec.epochs * n / self.plan.rows_per_step))
        from transformers import AutoConfig

        self.pad_id = AutoConfig.from_pretrained(self.job.base_model_path).pad_token_id or 0
        self.eval_rows = [[] for _ in range(self.world)]

    def _setup_on_policy(self) -> None:
        """The teacher scorer, the student's tokenizer and stop ids, the step schedule and the round files."""
        from transformers import AutoTokenizer, GenerationConfig

        from campaign_orchestrator.dataset.formatting import prompt_token_ids

        job, op = self.job.on_policy, self.op
        self.student_tok = AutoTokenizer.from_pretrained(self.job.base_model_path)
        self.stop_ids = []
        try:
            eos = GenerationConfig.from_pretrained(self.job.base_model_path).eos_token_id
            self.stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
        except OSError:  # no generation_config.json
            pass
        if self.student_tok.eos_token_id is not None and self.student_tok.eos_token_id not in self.stop_ids:
            self.stop_ids.append(self.student_tok.eos_token_id)
        if self.moe is not None:
            raise TrainingError(
                "training.distillation.loss 'on_policy' does not train mixture-of-experts students yet "
                "(no load-balancing loss on sampled batches): use loss 'logits' or 'sequence'"
            )
        self._prompt_token_ids = prompt_token_ids
        self.student_prompt_ids: dict[int, list[int]] = {}
        chat = bool(job.teacher.get("chat", False))
        self.teacher_prompts = [
            on_policy.teacher_prompt(p["prompt"], p.get("category"), job.context, job.context_categories, chat)
            for p in self.prompts
        ]
        per_step = self.spec.micro_batch_size * self.world * self.spec.gradient_accumulation_steps
        self.schedule = on_policy.Schedule(
            op.lambda_,
            op.warmup_steps,
            self.spec.seed,
            op.samples_per_round // per_step,
            len(self.prompts),
            op.samples_per_round // self.world,
            self.world,
        )
        self.round_store = on_policy.RoundStore(self.out / "rounds")
        try:
            self.scorer = on_policy.make_scorer(job, self.job.teacher_tokenizer_path, self.device, self.report.log)
        except ValueError as e:
            raise TrainingError(str(e)) from e
        self.report.log(
            f"on-policy (GKD): lambda {op.lambda_}, beta {op.beta}, {op.samples_per_round} samples per round "
            f"({self.schedule.steps_per_round} steps), teacher top-{op.top_k} ({job.teacher_backend}), student "
            f"sampling temperature {op.temperature}, max_new_tokens {op.max_new_tokens}"
            + (f", {op.warmup_steps} sequence-KD warmup steps" if op.warmup == "sequence_kd" else "")
        )

    # ------------------------------------------------------------------ on-policy rounds
    def _student_prompt(self, i: int) -> list[int]:
        ids = self.student_prompt_ids.get(i)
        if ids is None:
            ids = self._prompt_token_ids(self.student_tok, self.prompts[i]["prompt"], self.job.on_policy.template)
            self.student_prompt_ids[i] = ids
        return ids

    def _all_done(self, local_done: bool) -> bool:
        """Whether every rank's samples are done (collective: every rank calls it once per decoding step). A stop
        requested on any rank (SIGTERM) interrupts the round on every rank (``RoundInterrupted``)."""
        stop = float(self._stop_signal is not None)
        if self.world == 1:
            if stop:
                raise on_policy.RoundInterrupted
            return local_done
        flag = torch.tensor([0.0 if local_done else 1.0, stop], dtype=torch.float64)
        dist.all_reduce(flag)
        if float(flag[1]) > 0:
            raise on_policy.RoundInterrupted
        return float(flag[0]) == 0.0

    def _sample_round(self, r: int) -> tuple[list[on_policy.ScoredSample], dict]:
        """This rank's share of round ``r``: the student samples with its current weights, the teacher scores."""
        op = self.op
        idx = self.schedule.round_prompts(r, self.rank)
        prompt_ids = [self._student_prompt(i) for i in idx]
        gen = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + r * 1_009 + self.rank)
        t0 = time.perf_counter()
        self.model.eval()
        try:
            with on_policy.decoding_attention(self.model):
                completions, steps = on_policy.sample(
                    self.model,
                    prompt_ids,
                    max_new_tokens=op.max_new_tokens,
                    temperature=op.temperature,
                    stop_ids=self.stop_ids,
                    pad_id=self.pad_id,
                    generator=gen,
                    device=self.device,
                    all_done=self._all_done,
                )
        finally:
            self.model.train()
        t1 = time.perf_counter()
        self._all_done(True)  # a stop that came while sampling: leave before the teacher scores (collective)
        generated = getattr(self.scorer, "completion_tokens", 0)
        scored = on_policy.score_samples(
            self.scorer, [self.teacher_prompts[i] for i in idx], idx, prompt_ids, completions, op.top_k
        )
        generated = getattr(self.scorer, "completion_tokens", 0) - generated
        t2 = time.perf_counter()
        stops = set(self.stop_ids)
        stats = {
            "samples": len(scored),
            "sampled_tokens": sum(len(c) for c in completions),
            "teacher_prefill_tokens": sum(x.prefill_tokens for x in scored),
            "stopped": sum(1 for c in completions if c and c[-1] in stops),
            "decode_steps": steps,
            "sampling_seconds": t1 - t0,
            "scoring_seconds": t2 - t1,
            "unscored": len(completions) - len(scored),
            "teacher_completion_tokens": generated,
        }
        return scored, stats

    def _round(self, r: int) -> list[on_policy.ScoredSample]:
        """This rank's scored samples of round ``r``: read back from its round file (a relaunch mid-round), else
        sampled and scored now and written (collective: every rank enters at the same step)."""
        if r in self.rounds:
            return self.rounds[r]
        self.rounds.clear()
        loaded = self.round_store.load(r, self.rank)
        have = torch.tensor([float(loaded is not None)], dtype=torch.float64)
        self._all_reduce(have)
        if int(have[0]) == self.world:
            samples, stats = loaded
            self.report.log(f"round {r + 1}: samples read back from {self.round_store.dir} (a relaunch mid-round)")
        else:
            samples, stats = self._sample_round(r)
            self.round_store.save(r, self.rank, samples, stats)
        totals = torch.tensor(
            [
                stats["samples"],
                stats["sampled_tokens"],
                stats["teacher_prefill_tokens"],
                stats["stopped"],
                stats["unscored"],
                stats.get("teacher_completion_tokens", 0),
            ],
            dtype=torch.float64,
        )
        self._all_reduce(totals)
        secs = torch.tensor(
            [stats["sampling_seconds"], stats["scoring_seconds"], stats["decode_steps"]], dtype=torch.float64
        )
        if self.world > 1:
            dist.all_reduce(secs, op=dist.ReduceOp.MAX)  # ranks sample and score side by side: the slowest counts
        n, sampled, prefill, stopped, unscored, generated = (int(x) for x in totals.tolist())
        if not samples:
            raise TrainingError(
                f"round {r + 1}: the teacher scored none of rank {self.rank}'s samples (each prompt "
                f"+ sample longer than its context?); lower "
                f"training.distillation.on_policy.max_new_tokens"
            )
        acc = self._round_acc.setdefault(r, on_policy.RoundStats(round=r + 1))
        acc.samples, acc.sampled_tokens, acc.teacher_prefill_tokens, acc.stopped = n, sampled, prefill, stopped
        acc.teacher_completion_tokens = generated
        acc.sampling_seconds, acc.scoring_seconds, acc.decode_steps = secs[0].item(), secs[1].item(), int(secs[2])
        acc.extra["unscored"] = unscored
        self.report.log(
            f"round {r + 1}: {n} samples ({sampled} tokens, {stopped} stopped, mean "
            f"{sampled / max(1, n):.1f} tokens) in {acc.sampling_seconds:.1f}s; teacher scored {prefill} "
            f"prefill tokens in {acc.scoring_seconds:.1f}s" + (f"; {unscored} unscored" if unscored else "")
        )
        self.rounds[r] = samples
        self._round_ready = time.perf_counter()
        return samples

    def prepare_on_policy(
        self, step: int, control: tuple[float, ...] = ()
    ) -> tuple[list[dict], list[int], list[float]]:
        """This rank's micro-batches of on-policy ``step`` (its round's samples, in order) and the step's global
        [KL tokens, real tokens]; ``control`` as in :meth:`prepare`."""
        r, offset = self.schedule.round_of(step)
        samples = self._round(r)
        micro, accum = self.spec.micro_batch_size, self.spec.gradient_accumulation_steps
        batches = []
        for a in range(accum):
            lo = (offset * accum + a) * micro
            part = samples[lo : lo + micro]
            b = on_policy.batch(part or samples[:1], self.pad_id, self.spec.max_seq_len)
            if not part:  # fewer scored samples than planned: a forward and backward with no loss token
                b["labels"].fill_(losses.IGNORE)
            batches.append(b)
        counts = torch.tensor(
            [sum(self._kl_token_count(b) for b in batches), sum(data.real_token_count(b) for b in batches), *control],
            dtype=torch.float64,
        )
        self._all_reduce(counts)
        return batches, [int(c) for c in counts[:2].tolist()], counts[2:].tolist()

    def accumulate_on_policy(self, batches: list[dict], counts: list[int]) -> StepResult | None:
        """Forward/backward of the generalized JSD on the sampled positions, normalized by the global count."""
        kl_tokens, real_tokens = counts
        if kl_tokens == 0:
            return None
        beta = self.op.beta

        def loss_step(b: dict) -> tuple[float, float]:
            b = self._scored({k: v.to(self.device) for k, v in b.items()})
            log_p, log_q, valid, _ = losses.topk_buckets(
                self._forward(b), b["labels"], b[losses.TEACHER_IDS], b[losses.TEACHER_LOGPROBS]
            )
            jsd = losses.generalized_jsd(log_p, log_q, valid, beta).sum()
            with torch.no_grad():
                rkl = losses.generalized_jsd(log_p, log_q, valid, 1.0).sum()
            (jsd * (self.world / kl_tokens)).backward()  # FSDP averages over ranks: scale by world (exact sum)
            return float(jsd.detach()), float(rkl)

        sums = self.step_sums(batches, loss_step)
        jsd_mean, rkl_mean = float(sums[0]) / kl_tokens, float(sums[1]) / kl_tokens
        tokens = (kl_tokens, kl_tokens, real_tokens)
        return StepResult.unclipped(jsd_mean, tokens, kl=jsd_mean, reverse_kl=rkl_mean)

    def _finish_round(self, r: int, completed: int) -> None:
        """A round's last step is done: log and report it (samples, mean reverse KL, teacher tokens), checkpoint."""
        acc = self._round_acc.pop(r)
        row = acc.as_row() | {"step": completed, "unscored": acc.extra.get("unscored", 0)}
        self.round_stats.append(row)
        self.rounds.pop(r, None)
        mean = acc.mean_reverse_kl
        self.report.log(
            f"round {r + 1} done at step {completed}: {acc.samples} samples, mean reverse KL "
            f"{'n/a' if mean is None else f'{mean:.4f}'}, teacher scored {acc.teacher_prefill_tokens} "
            f"tokens"
        )
        if self.is_main:
            self.report.metrics({"kind": "on_policy_round", **row})  # the whole round (a budget guard charges it)
            # and as an observation of the asset (the launcher turns train_metrics into AssetObservations)
            self.report.metrics(
                {
                    "step": completed,
                    "round": r + 1,
                    "round_samples": acc.samples,
                    "round_sampled_tokens": acc.sampled_tokens,
                    "round_mean_reverse_kl": mean,
                    "round_teacher_prefill_tokens": acc.teacher_prefill_tokens,
                }
            )
        if completed < self.total_steps:
            self.save_checkpoint(completed, reason="round")
        # a relaunch resumes from the newest checkpoint, at this round's end or later: earlier rounds' files go (one
        # resumed from an older checkpoint inside an earlier round would sample that round again)
        self.round_store.prune(r, self.rank)

    def _on_policy_summary(self) -> dict:
        rows = self.round_stats
        on = sum(1 for s in range(self.total_steps) if self.schedule.on_policy(s))
        kl_tokens = sum(r["kl_tokens"] for r in rows)
        rkl = sum((r["mean_reverse_kl"] or 0.0) * r["kl_tokens"] for r in rows)
        total = {
            k: sum(r.get(k, 0) for r in rows)
            for k in (
                "samples",
                "sampled_tokens",
                "teacher_prefill_tokens",
                "teacher_completion_tokens",
                "sampling_seconds",
                "scoring_seconds",
            )
        }
        return {
            "rounds": len(rows),
            "on_policy_steps": on,
            "off_policy_steps": self.total_steps - on,
            "lambda": self.op.lambda_,
            "beta": self.op.beta,
            "samples_per_round": self.op.samples_per_round,
            "top_k": self.op.top_k,
            "teacher_backend": self.job.on_policy.teacher_backend,
            **total,
            "mean_reverse_kl": rkl / kl_tokens if kl_tokens else None,
            "first_round_reverse_kl": rows[0]["mean_reverse_kl"] if rows else None,
            "last_round_reverse_kl": rows[-1]["mean_reverse_kl"] if rows else None,
            "per_round": rows,
        }

    # ------------------------------------------------------------------ the step's parts
    def _setup_model(self) -> None:
        super()._setup_model()
        self._setup_on_policy()

    def _prepare_step(
        self, step: int, control: tuple[float, ...], t0: float
    ) -> tuple[list[dict], list[int], list[float], float]:
        if not self.schedule.on_policy(step):
            return super()._prepare_step(step, control, t0)
        try:
            batches, counts, flags = self.prepare_on_policy(step, control)
        except on_policy.RoundInterrupted:  # no round file was written: a relaunch samples it again, the same
            self.save_checkpoint(step, reason="preempted")
            raise TrainingError(
                f"stopped by SIGTERM while round {self.schedule.round_of(step)[0] + 1} sampled, before "
                f"step {step + 1}; checkpoint {self.store.path(step)} written, a relaunch samples the "
                "round again with the same weights and seed"
            ) from None
        return batches, counts, flags, max(t0, self._round_ready)  # a round's sampling and scoring is not training

    def _accumulate_step(self, step: int, batches: list[dict], counts: list[int]) -> StepResult | None:
        if not self.schedule.on_policy(step):
            return super()._accumulate_step(step, batches, counts)
        result = self.accumulate_on_policy(batches, counts)
        if result is not None:
            acc = self._round_acc[self.schedule.round_of(step)[0]]
            acc.reverse_kl_sum += result.reverse_kl * result.kl_tokens
            acc.kl_tokens += result.kl_tokens
        return result

    def _step_metrics(self, step: int, result: StepResult) -> dict:
        on = self.schedule.on_policy(step)
        return super()._step_metrics(step, result) | {
            "kind": "on_policy" if on else "off_policy",
            "round": self.schedule.round_of(step)[0] + 1 if on else None,
            "reverse_kl": result.reverse_kl,
        }

    def _step_note(self, step: int, result: StepResult) -> str:
        if self.schedule.on_policy(step):
            return f" (on-policy, round {self.schedule.round_of(step)[0] + 1}, reverse KL {result.reverse_kl:.4f})"
        return " (off-policy)"

    def _end_step(self, step: int) -> None:
        if self.schedule.on_policy(step):
            r, offset = self.schedule.round_of(step)
            if offset + 1 == self.schedule.steps_per_round:
                self._finish_round(r, step + 1)

    def _before_final_checkpoint(self) -> None:
        for r in sorted(self._round_acc):  # a last round cut short by max_steps: its samples were paid for all the same
            self._finish_round(r, self.total_steps)

    def _describe_step_rows(self, step: int) -> str:
        if self.schedule.on_policy(step):
            r, offset = self.schedule.round_of(step)
            return f"on-policy round {r + 1}, its step {offset + 1}, samples in {self.round_store.dir}"
        return super()._describe_step_rows(step)

    def _trainer_state(self, step: int) -> dict:
        return super()._trainer_state(step) | {
            "on_policy": {
                "rounds": self.round_stats,
                "in_progress": {str(r): {k: v for k, v in vars(a).items()} for r, a in self._round_acc.items()},
            }
        }

    def _restore_state(self, state: dict) -> None:
        super()._restore_state(state)
        if state.get("on_policy"):
            self.round_stats = list(state["on_policy"]["rounds"])
            self._round_acc = {int(r): on_policy.RoundStats(**a) for r, a in state["on_policy"]["in_progress"].items()}

    def _summary_extras(self) -> dict:
        return super()._summary_extras() | {"on_policy": self._on_policy_summary()}
