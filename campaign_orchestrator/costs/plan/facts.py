"""What the campaign's data says before anything runs: prompt counts after the held-out split, mean prompt lengths
in each model's tokens (chat template and teacher context included), evaluation suite sizes
(:class:`DataFacts`, made by :func:`data_facts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from campaign_orchestrator.costs.memory import PlanError
from campaigns.spec import CampaignSpec

TOKEN_SAMPLE = 2000  # prompts tokenized to estimate the mean prompt length


@dataclass(frozen=True)
class DataFacts:
    """The campaign's data as the planner counts it. Token counts are means per prompt, in the named model's
    tokens, its chat template included (the teacher's: with its ``teacher.context`` messages)."""

    train_prompts: int  # training prompts after the held-out split
    prompt_tokens_teacher: float  # a training prompt as the teacher reads it
    prompt_tokens_student: float = 0.0  # a training prompt as the student reads it
    heldout_items: int = 0
    heldout_prompt_tokens_student: float = 0.0
    heldout_prompt_tokens_teacher: float = 0.0
    template_tokens_teacher: float = 0.0  # what the teacher's template and context add around a prompt
    template_tokens_student: float = 0.0  # what the student's chat template adds
    context_share: float = 1.0  # the share of training prompts asked with the teacher's context (context_categories)
    shared_prefix_tokens: float = 0.0  # the prefix every teacher prompt shares (its context), prefilled once per call
    suites: dict[str, tuple[int, float]] = field(default_factory=dict)  # suite -> (items, mean student prompt tokens)
    suite_context_share: dict[str, float] = field(default_factory=dict)  # suite -> share asked with the context
    tokenizer: str = "model tokenizer"  # how tokens were counted ("~4 characters per token" without a tokenizer)


def _tokenizer(model_dir: Path | None):
    if model_dir is None or not (Path(model_dir) / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tok.no_padding()  # a saved tokenizer may pad batches to a common length; we want true lengths
    tok.no_truncation()
    return tok


def _mean_tokens(tok, texts: list[str]) -> float:
    if not texts:
        return 0.0
    if tok is None:  # no tokenizer at hand (an API teacher): ~4 characters per token
        return sum(len(t) for t in texts) / len(texts) / 4
    return sum(len(e.ids) for e in tok.encode_batch(texts)) / len(texts)


def template_overhead(model_dir: Path | None, prompt: str, context: list[dict] | None = None) -> float:
    """Tokens the model's chat template (and a teacher's context messages) add around a prompt, measured by
    rendering it exactly as generation and training do (0 without a chat template)."""
    if model_dir is None or not prompt or not (Path(model_dir) / "tokenizer_config.json").exists():
        return 0.0
    from transformers import AutoTokenizer

    from campaign_orchestrator.dataset.formatting import FormatError, render_prompt_ids, tokenize_texts

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    try:
        messages = [*(context or []), {"role": "user", "content": prompt}]
        rendered = render_prompt_ids(tok, messages if context else prompt)
    except FormatError:
        return 0.0
    return float(len(rendered) - len(tokenize_texts(tok, [prompt])[0]))


def suite_file_rows(spec: CampaignSpec) -> dict[str, list[dict]]:
    """The rows of every evaluation suite read from a file (not ``heldout``), read once for the plan."""
    from campaign_orchestrator.dataset.jsonl import jsonl_objects

    out = {}
    for s in spec.evaluation.suites:
        if s.source == "heldout":
            continue
        p = spec.path(s.source)
        if not p.exists():
            raise PlanError(f"evaluation suite {s.name!r}: source {s.source!r} not found at {p}")
        out[s.name] = [obj for _n, obj in jsonl_objects(p.read_text(encoding="utf-8"), p, PlanError)]
    return out


def suite_sizes(
    spec: CampaignSpec, files: dict[str, list[dict]], tok, held: int, held_tokens: float, overhead: float
) -> dict[str, tuple[int, float]]:
    """Per suite: (items, mean prompt tokens as the student sees them): the held-out split, or the suite's file
    (``files``: :func:`suite_file_rows`)."""
    out = {}
    for s in spec.evaluation.suites:
        if s.source == "heldout":
            out[s.name] = (held, held_tokens)
            continue
        rows = files[s.name]
        out[s.name] = (len(rows), _mean_tokens(tok, [str(r.get("prompt", "")) for r in rows[:TOKEN_SAMPLE]]) + overhead)
    return out


def suite_context_shares(spec: CampaignSpec, held: list[dict], files: dict[str, list[dict]]) -> dict[str, float]:
    """Per suite: the share of its items the teacher is asked with its ``teacher.context`` (those of
    ``teacher.context_categories``; every item when that is unset, none without a context), as the evaluation
    stage asks it (item categories as :mod:`evaluation.suite` reads them: ``all`` when missing)."""
    t, out = spec.teacher, {}
    for s in spec.evaluation.suites:
        if not t.context or t.context_categories is None:
            out[s.name] = 1.0 if t.context else 0.0
            continue
        if s.source == "heldout":
            cats = [str(r.get("category") or "all") for r in held if r.get("reference") is not None]
        else:
            cats = [str(r.get("category", "all")) for r in files[s.name]]
        out[s.name] = sum(c in t.context_categories for c in cats) / len(cats) if cats else 0.0
    return out


def teacher_answers_as_base(spec: CampaignSpec) -> bool:
    """Whether the teacher's bare-prompt evaluation answers are the base's (found in the generation cache under
    the same key, :func:`campaign_orchestrator.generation.backends.answer_identity`): a ``transformers`` teacher over
    the student's base weights (same model and revision) in the same compute dtype, the base not 4-bit. The
    model fields are compared as written (no weights are hashed to plan): the same weights named two ways are
    planned as two models, an over-estimate."""
    t, s = spec.teacher, spec.student
    q = s.quantization
    return (
        t.backend == "transformers"
        and t.model == s.base_model
        and t.revision == s.revision
        and t.compute_dtype == q.compute_dtype
        and not q.load_in_4bit
    )


def data_facts(spec: CampaignSpec, repo_root: Path, teacher_dir: Path | None, student_dir: Path | None) -> DataFacts:
    """Prompt counts after the held-out split and mean prompt lengths in each model's tokens."""
    from campaign_orchestrator.dataset import prompts as P

    d = spec.data
    rows = P.read_prompts(
        P.source_files(d.source, repo_root),
        P.SourceFields(d.id_field, d.prompt_field, d.reference_field, d.category_field),
    )
    train, held = P.split(rows, d.heldout.fraction, d.heldout.seed, d.heldout.max_items)
    sample = [r["prompt"] for r in train[:TOKEN_SAMPLE]]
    held_sample = [r["prompt"] for r in held[:TOKEN_SAMPLE]]
    t_tok, s_tok = _tokenizer(teacher_dir), _tokenizer(student_dir)
    first = sample[0] if sample else ""
    ctx = [m.model_dump() for m in spec.teacher.context]
    t_over = template_overhead(teacher_dir, first, ctx) if spec.teacher.backend == "transformers" else 0.0
    s_over = template_overhead(student_dir, first)
    files = suite_file_rows(spec)
    return DataFacts(
        train_prompts=len(train),
        heldout_items=len(held),
        prompt_tokens_teacher=_mean_tokens(t_tok, sample) + t_over,
        prompt_tokens_student=_mean_tokens(s_tok, sample) + s_over,
        heldout_prompt_tokens_student=_mean_tokens(s_tok, held_sample) + s_over,
        heldout_prompt_tokens_teacher=_mean_tokens(t_tok, held_sample) + t_over,
        template_tokens_teacher=t_over,
        template_tokens_student=s_over,
        context_share=(
            sum(r.get("category") in spec.teacher.context_categories for r in train) / len(train)
            if spec.teacher.context_categories is not None and train
            else 1.0
        ),
        shared_prefix_tokens=max(0.0, t_over - s_over),
        suites=suite_sizes(spec, files, s_tok, len(held), _mean_tokens(s_tok, held_sample) + s_over, s_over),
        suite_context_share=suite_context_shares(spec, held, files),
        tokenizer="model tokenizer" if t_tok is not None else "~4 characters per token",
    )


def route_shares(spec: CampaignSpec, repo_root: Path) -> dict[str, tuple[float, float]]:
    """Several teachers: each one's share of the training prompts and of the held-out items (routed by category,
    the default teacher taking the rest), as the teacher stage and evaluation route them."""
    from campaign_orchestrator.dataset import prompts as P

    d = spec.data
    rows = P.read_prompts(
        P.source_files(d.source, repo_root),
        P.SourceFields(d.id_field, d.prompt_field, d.reference_field, d.category_field),
    )
    train, held = P.split(rows, d.heldout.fraction, d.heldout.seed, d.heldout.max_items)

    def shares(part: list[dict]) -> dict[str, float]:
        n = {e.name: 0 for e in spec.teachers}
        for r in part:
            n[spec.teacher_for(r.get("category")).name] += 1
        return {k: v / len(part) if part else 0.0 for k, v in n.items()}

    tr, he = shares(train), shares(held)
    return {e.name: (tr[e.name], he[e.name]) for e in spec.teachers}
