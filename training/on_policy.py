"""On-policy distillation (GKD, Agarwal et al. 2024): rounds of student samples scored by the teacher.

``training.distillation.loss: on_policy``. Training steps are of two kinds, a pure function of the step
(:class:`Schedule`, the same on every rank): the first ``warmup_steps`` (``warmup: sequence_kd``) and a
fraction ``1 - lambda`` of the rest are off-policy steps on the tokenized teacher generations (the trainer's
sequence-KD step, cross-entropy); the others are on-policy. On-policy steps come in **rounds**: a round
starts when its first step is due; every rank

1. takes its share of ``samples_per_round`` training prompts (a seeded permutation of the prompts, epochs
   laid end to end: :meth:`Schedule.round_prompts`),
2. samples one completion per prompt with the student's *current* weights (:func:`sample`: one forward per
   decoding step on every rank until every rank's rows are done, since under FSDP2 each forward is a
   collective; the all-reduced flag is what keeps a rank that finished early stepping, TRL #2580),
3. has the teacher score every sampled token (a :class:`~campaign_orchestrator.teacher.scoring.TeacherScorer`:
   the top-k log-probabilities at each position, one prefill of the teacher's own prompt, i.e. for context
   distillation the context + the user turn, while the student sees the bare prompt),
4. writes the scored samples to ``<output>/rounds/`` (so a run killed mid-round resumes on the same samples),

and the round's steps then train on them: ``samples_per_round / (micro × world × accumulation)`` steps whose
loss is the generalized JSD (``training.losses.generalized_jsd_sum``) on the sampled positions only: the
labels are the sampled tokens (stop token included), the prompt is masked.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from training import data as tdata
from training import losses

ROUND_FORMAT = 1


class RoundInterrupted(Exception):
    """A stop (SIGTERM) arrived while a round was sampling or scoring: every rank leaves the round together."""


# --------------------------------------------------------------------------- schedule


class Schedule:
    """Which steps are on-policy and which round and offset each belongs to (a pure function of the step)."""

    def __init__(
        self,
        lambda_: float,
        warmup_steps: int,
        seed: int,
        steps_per_round: int,
        prompts: int,
        samples_per_rank: int,
        world: int,
    ):
        self.lambda_, self.warmup_steps, self.seed = lambda_, warmup_steps, seed
        self.steps_per_round = steps_per_round
        self.prompt_plan = tdata.BatchPlan(prompts, samples_per_rank, world, 1, seed)
        self._before: list[int] = [0]  # _before[s]: on-policy steps before step s

    def on_policy(self, step: int) -> bool:
        if step < self.warmup_steps:
            return False
        if self.lambda_ >= 1.0:
            return True
        return random.Random(f"{self.seed}:{step}").random() < self.lambda_

    def index(self, step: int) -> int:
        """On-policy steps before ``step``."""
        while len(self._before) <= step:
            s = len(self._before) - 1
            self._before.append(self._before[-1] + self.on_policy(s))
        return self._before[step]

    def round_of(self, step: int) -> tuple[int, int]:
        """``(round, offset)`` of an on-policy ``step``: its round and its place among the round's steps."""
        return divmod(self.index(step), self.steps_per_round)

    def round_prompts(self, round_index: int, rank: int) -> list[int]:
        """Indexes of the prompts ``rank`` samples in ``round_index``."""
        return self.prompt_plan.step_rows(round_index, rank)[0]


# --------------------------------------------------------------------------- prompts


def teacher_prompt(prompt: str, category: str | None, context: Sequence[dict], context_categories, chat: bool):
    """What the teacher is asked for ``prompt``: as the teacher stage asks it (``generation.requests.build_requests``):
    the context messages and the user turn, or the bare prompt (no context, or a category without it)."""
    from campaign_orchestrator.generation.requests import chat_messages

    ctx = context if context_categories is None or category in context_categories else ()
    return chat_messages(prompt, ctx) if (chat or ctx) else prompt


# --------------------------------------------------------------------------- sampling


@contextlib.contextmanager
def decoding_attention(model):
    """Decode with a kernel that takes a key/value cache and a padding mask: ``segment_eager`` (the trainer's
    per-sequence kernel) reads sequences off the position ids of the queries alone, so sampling uses eager."""
    configs = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")]
    saved = [c._attn_implementation for c in configs]
    try:
        for c, impl in zip(configs, saved, strict=False):
            if impl not in ("eager", "sdpa"):
                c._attn_implementation = "eager"
        yield
    finally:
        for c, impl in zip(configs, saved, strict=False):
            c._attn_implementation = impl


def _cache_keyword(model) -> str:
    """The name the causal LM's forward takes its key/value cache under (``cache`` in newer transformers,
    ``past_key_values`` before), looked up on the model under the PEFT and FSDP wrappers."""
    import inspect

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def _returned_cache(out):
    cache = getattr(out, "past_key_values", None)
    return cache if cache is not None else getattr(out, "cache", None)


@torch.no_grad()
def sample(
    model,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator,
    device: torch.device,
    all_done: Callable[[bool], bool] = lambda done: done,
) -> tuple[list[list[int]], int]:
    """One completion per prompt (token ids, the stop token included when one was sampled) and the number of
    decoding steps taken. Left-padded batch, key/value cache, ``temperature`` 0 greedy. ``all_done(local)``
    tells whether every rank's rows are done (an all-reduce under FSDP2): a rank whose rows all stopped keeps
    running forwards (on pad tokens) until then, so every rank runs the same number of forwards."""
    from transformers import DynamicCache

    cache_kw = _cache_keyword(model)
    n = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        use_cache=True,
        logits_to_keep=1,
        **{cache_kw: DynamicCache()},
    )
    cache, pos = _returned_cache(out), pos[:, -1:]
    done = torch.zeros(n, dtype=torch.bool)
    stops = set(int(s) for s in stop_ids)
    gen: list[list[int]] = [[] for _ in range(n)]
    steps = 0
    for step in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1).cpu()
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1).cpu()
        steps += 1
        for r in range(n):
            if not done[r]:
                t = int(nxt[r])
                gen[r].append(t)
                if t in stops or len(gen[r]) >= max_new_tokens:
                    done[r] = True
        if all_done(bool(done.all())) or step + 1 == max_new_tokens:
            break
        feed = torch.where(done, torch.full_like(nxt, pad_id), nxt).to(device)
        mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
        pos = pos + 1
        out = model(input_ids=feed[:, None], attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kw: cache})
        cache = _returned_cache(out)
    return gen, steps


# --------------------------------------------------------------------------- scored samples and batches


@dataclass
class ScoredSample:
    """One student sample and the teacher's judgement of it."""

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    topk_ids: list[list[int]]  # per completion token: the teacher's top-k ids at that position
    topk_logprobs: list[list[float]]
    prefill_tokens: int  # the teacher's prompt + the continuation: what scoring it cost


@dataclass
class RoundStats:
    """One round, as logged and reported (global: summed over ranks)."""

    round: int
    samples: int = 0
    sampled_tokens: int = 0
    teacher_prefill_tokens: int = 0
    teacher_completion_tokens: int = 0  # what a server generated besides (prompt_logprobs asks max_tokens 1 per pair)
    sampling_seconds: float = 0.0
    scoring_seconds: float = 0.0
    decode_steps: int = 0
    stopped: int = 0  # samples that ended on a stop token (the rest hit max_new_tokens)
    reverse_kl_sum: float = 0.0
    kl_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def mean_reverse_kl(self) -> float | None:
        return self.reverse_kl_sum / self.kl_tokens if self.kl_tokens else None

    def as_row(self) -> dict:
        row = {k: v for k, v in asdict(self).items() if k not in ("extra", "reverse_kl_sum")}
        return row | {"mean_reverse_kl": self.mean_reverse_kl}


def score_samples(
    scorer,
    teacher_prompts: Sequence,
    prompt_index: Sequence[int],
    prompt_ids: Sequence[list[int]],
    completions: Sequence[list[int]],
    top_k: int,
) -> list[ScoredSample]:
    """The teacher's top-k at every sampled position; a sample it could not score (too long for its context)
    is dropped, never trained on without a teacher."""
    scored = scorer.score(list(teacher_prompts), [list(c) for c in completions], top_k)
    out = []
    for i, s in enumerate(scored):
        c = completions[i]
        if s.error or not c:
            continue
        ids = [[t for t, _, _ in pos] for pos in s.top_logprobs]
        lps = [[float(lp) for _, _, lp in pos] for pos in s.top_logprobs]
        out.append(
            ScoredSample(int(prompt_index[i]), list(prompt_ids[i]), list(c), ids, lps, int(s.prompt_tokens) + len(c))
        )
    return out


def batch(samples: Sequence[ScoredSample], pad_id: int, max_seq_len: int) -> dict[str, torch.Tensor]:
    """A padding-free micro-batch of samples (as ``training.data.collate`` lays packed rows: one row, position ids
    restarting per sample) with labels on the sampled tokens and the teacher's top-k aligned with them."""
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    t_ids: list[list[int]] = []
    t_lps: list[list[float]] = []
    for s in samples:
        ids = (s.prompt_ids + s.completion_ids)[:max_seq_len]
        p = len(s.prompt_ids)
        labels = ([losses.IGNORE] * p + s.completion_ids)[:max_seq_len]
        labels[0] = losses.IGNORE
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
        rows["position_ids"].append(list(range(len(ids))))
        t_ids += ([[]] * p + s.topk_ids)[: len(ids)]
        t_lps += ([[]] * p + s.topk_logprobs)[: len(ids)]
    out = tdata.collate(rows, list(range(len(samples))), pad_id, padding="free")
    width = out["input_ids"].shape[1]
    out[losses.TEACHER_IDS], out[losses.TEACHER_LOGPROBS] = losses.teacher_topk_tensors([t_ids], [t_lps], width)
    return out


# --------------------------------------------------------------------------- round files


class RoundStore:
    """``<output>/rounds/round-<r>-rank<k>.pt``: each rank's scored samples of a round, written once, atomically,
    before the round trains; a relaunch mid-round reads them back instead of sampling with other weights."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)

    def path(self, round_index: int, rank: int) -> Path:
        return self.dir / f"round-{round_index:05d}-rank{rank:03d}.pt"

    def save(self, round_index: int, rank: int, samples: list[ScoredSample], stats: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.path(round_index, rank)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        torch.save({"format": ROUND_FORMAT, "samples": [asdict(s) for s in samples], "stats": stats}, tmp)
        os.replace(tmp, final)

    def prune(self, before: int, rank: int) -> None:
        """Delete ``rank``'s files of rounds before ``before`` (no kept checkpoint is inside them)."""
        for f in self.dir.glob(f"round-*-rank{rank:03d}.pt"):
            if int(f.name.split("-")[1]) < before:
                f.unlink(missing_ok=True)

    def load(self, round_index: int, rank: int) -> tuple[list[ScoredSample], dict] | None:
        f = self.path(round_index, rank)
        if not f.exists():
            return None
        d = torch.load(f, weights_only=True)
        if d.get("format") != ROUND_FORMAT:
            return None
        return [ScoredSample(**s) for s in d["samples"]], d["stats"]


# --------------------------------------------------------------------------- the teacher beside the student


class LocalScorer:
    """:class:`~campaign_orchestrator.teacher.scoring.TeacherScorer` over an in-process teacher: a thin shell over a
    :class:`~campaign_orchestrator.generation.local.LocalModel` that meters prefill tokens. Prompts that share a
    long prefix (context distillation: the system prompt and few-shot turns before every prompt of a category)
    are scored with that prefix's key/value cache computed once per call (:meth:`_score_group`, the technique of
    the generator's own prefix caching); the rest through
    :meth:`~campaign_orchestrator.generation.local.LocalModel.score` (one forward pass per batch). Both give the
    same log-probabilities (``tests/training/test_on_policy_scoring.py``)."""

    def __init__(self, generator, identity: str, prefix_caching: bool = True):
        self.generator = generator
        self.identity = identity
        self.prefix_caching = prefix_caching
        self.prefill_tokens = 0

    @classmethod
    def load(cls, model_path: str, compute_dtype: str, device: torch.device, identity: str, batch_size: int = 16):
        from campaign_orchestrator.generation.local import LocalModel

        gen = LocalModel.from_path(model_path, compute_dtype=compute_dtype, batch_size=batch_size, device=str(device))
        return cls(gen, identity)

    def score(self, prompts, continuations, top_k: int):
        from campaign_orchestrator.dataset.formatting import render_prompt_ids
        from campaign_orchestrator.generation.local import PREFIX_MIN_TOKENS, prefix_groups

        gen = self.generator
        if len(prompts) != len(continuations):
            raise ValueError(
                f"score() takes one continuation per prompt: got {len(prompts)} prompts and "
                f"{len(continuations)} continuations"
            )
        enc = [render_prompt_ids(gen.tok, p) for p in prompts]
        cont = [list(c) for c in continuations]
        out: list = [None] * len(prompts)
        groups = prefix_groups(enc, PREFIX_MIN_TOKENS) if self.prefix_caching else [(list(range(len(enc))), 0)]
        for idx, shared in groups:
            fits = [
                i
                for i in idx
                if cont[i] and not (gen.context_length and len(enc[i]) + len(cont[i]) > gen.context_length)
            ]
            if shared >= PREFIX_MIN_TOKENS and len(fits) > 1:
                group = self._score_group([enc[i] for i in fits], [cont[i] for i in fits], shared, top_k)
                for i, scored in zip(fits, group or (), strict=False):
                    out[i] = scored
            rest = [i for i in idx if out[i] is None]
            if rest:
                scores = gen.score([prompts[i] for i in rest], [cont[i] for i in rest], top_k)
                for i, scored in zip(rest, scores, strict=False):
                    out[i] = scored
        self.prefill_tokens += sum(s.prompt_tokens + len(c) for s, c in zip(out, cont, strict=False) if not s.error)
        return out

    @torch.no_grad()
    def _score_group(self, enc: list[list[int]], cont: list[list[int]], shared: int, top_k: int) -> list | None:
        """Score prompts that start with the same ``shared`` tokens: the prefix's cache once, then batches of
        ``[prefix][pad][rest + continuation]`` rows (positions from the mask, as the generator's prefix caching)."""
        import copy

        from campaign_orchestrator.generation.local import Scored

        gen = self.generator
        prefix = enc[0][:shared]
        cache = gen._prefix_cache(prefix)
        if cache is None:  # a model whose cache cannot be reused: the caller takes the plain path
            return None
        out: list = [None] * len(enc)
        order = sorted(range(len(enc)), key=lambda i: len(enc[i]) + len(cont[i]))
        for start in range(0, len(order), gen.batch_size):
            idx = order[start : start + gen.batch_size]
            rows = [enc[i][shared:] + cont[i] for i in idx]
            width = max(len(r) for r in rows)
            ids, mask = gen._batch_inputs(rows, width, prefix)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            batch_cache = copy.deepcopy(cache)
            batch_cache.batch_repeat_interleave(len(idx))
            n_c = max(len(cont[i]) for i in idx)
            logits = gen.model(
                input_ids=ids[:, shared:],
                attention_mask=mask,
                position_ids=pos[:, shared:],
                use_cache=True,
                logits_to_keep=n_c + 1,
                **{_cache_keyword(gen.model): batch_cache},
            ).logits.float()
            lp = torch.log_softmax(logits[:, :-1], dim=-1)
            for row, i in enumerate(idx):
                c = cont[i]
                rows_lp = lp[row, n_c - len(c) :]
                vals = rows_lp.gather(-1, torch.tensor(c, device=rows_lp.device)[:, None])[:, 0].cpu().tolist()
                tv, ti = rows_lp.topk(min(top_k, rows_lp.shape[-1]), dim=-1)
                top = [
                    [(t, None, v) for t, v in zip(a, b, strict=True)]
                    for a, b in zip(ti.cpu().tolist(), tv.cpu().tolist(), strict=True)
                ]
                out[i] = Scored(list(c), vals, top, len(enc[i]))
        return out


def make_scorer(job, teacher_tokenizer: str | None, device: torch.device, log: Callable[[str], None]):
    """The teacher scorer for an :class:`training.config.OnPolicyJob`: in process for a ``transformers`` teacher,
    :class:`campaign_orchestrator.teacher.scoring_http.HTTPTeacherScorer` for an ``openai`` one (a server that
    returns ``prompt_logprobs``; ``teacher_tokenizer``: the teacher's tokenizer directory)."""
    if job.teacher_backend == "transformers":
        if not job.teacher_model_path:
            raise ValueError("an in-process teacher needs its directory (OnPolicyJob.teacher_model_path)")
        t0 = time.perf_counter()
        scorer = LocalScorer.load(job.teacher_model_path, job.teacher_compute_dtype, device, job.teacher_identity)
        log(
            f"on-policy: teacher {job.teacher_model_path} loaded beside the student in {time.perf_counter() - t0:.1f}s "
            f"({scorer.generator.precision.dtype if scorer.generator.precision else 'model dtype'})"
        )
        return scorer
    if job.teacher_backend == "openai":
        from campaign_orchestrator.teacher.scoring_http import HTTPTeacherScorer
        from campaigns.spec import TeacherSpec

        if not teacher_tokenizer:
            raise ValueError(
                "on-policy scoring by an `openai` teacher needs its tokenizer: set "
                "training.distillation.teacher_tokenizer to a directory holding it"
            )
        scorer = HTTPTeacherScorer.from_spec(TeacherSpec.model_validate(job.teacher), teacher_tokenizer)
        log(f"on-policy: teacher {scorer!r} scores over HTTP (prompt_logprobs)")
        return scorer
    raise ValueError(
        f"teacher.backend {job.teacher_backend!r} cannot score samples during training: use "
        "'transformers' (in process) or 'openai' (a server returning prompt_logprobs)"
    )
