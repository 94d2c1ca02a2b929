"""The ``data:`` and ``dataset:`` sections: prompt sources, the held-out split, filters, tokenization."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from campaigns.spec.common import _Strict
from campaigns.spec.lm_eval import DecontaminationSpec
from campaigns.spec.replay import ReplaySpec


class HeldoutSpec(_Strict):
    """The prompts held out of training for evaluation, chosen by id hash."""

    fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Share of prompts held out for evaluation, by id hash.")
    seed: int = Field(0, ge=0, description="Seed of the id-hash split.")
    max_items: int | None = Field(None, ge=1, description="Cap on held-out items (taken in id-hash order).")


class FilterSpec(_Strict):
    """Rules that turn teacher generations into the distillation set; each is counted."""

    drop_empty: bool = Field(True, description="Drop empty completions.")
    drop_truncated: bool = Field(True, description="Drop completions that stopped on the length limit.")
    format_regex: str | None = Field(None, description="Completions must fully match this regex.")
    dedupe: bool = Field(True, description="Drop exact duplicate (prompt, completion) pairs.")
    scorer: Literal["exact_match", "normalized_exact_match", "contains_answer"] | None = Field(
        None, description="Keep only completions the task's scorer rates >= `min_score` against the prompt's reference."
    )
    min_score: float = Field(1.0, ge=0.0, le=1.0, description="Threshold for `scorer`.")
    min_chars: int = Field(1, ge=0, description="Drop completions shorter than this (after stripping).")
    max_chars: int | None = Field(None, ge=1, description="Drop completions longer than this.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Drop completions longer than this many tokens.")

    @field_validator("format_regex")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a valid regular expression: {e}") from e
        return v


class TargetsSpec(_Strict):
    """Whose knowledge the training targets carry. ``content: teacher`` (default) trains on the teacher's answers.
    ``content: base`` keeps what the student knows while it learns the teacher's format: the student's base model
    answers every task prompt in its own words (the local engine and the generation cache, as ``data.replay``
    answers replay prompts; priced as local compute), and each target is built from that answer in the teacher's
    short form (``rule``). Where the teacher's answer says something the student does not hold (a fact it never
    knew, or one the teacher got wrong), training on it teaches the format and breaks the recall ("knew it, lost
    it" in the diagnosis). Measured: docs/results.md, "Keeping what the student knows"."""

    content: Literal["teacher", "base"] = Field(
        "teacher",
        description="teacher: the teacher's answers as they are; base: targets built from the student's base's own "
        "answers to the task prompts, in the teacher's short form (`rule`).",
    )
    rule: Literal["short_form", "short_form_or_reference", "agree", "known"] = Field(
        "short_form",
        description="`content: base`. short_form: the target is the teacher's short form (any answer the teacher gave "
        "in the task, normalized) that the base's answer names, written as the teacher writes it; rows whose base "
        "answer names none are dropped. short_form_or_reference: the same, the training prompts' references (the "
        "task's answer set) among the short forms too. agree: only the rows whose own teacher answer the base's "
        "answer names. known: only the rows whose base answer names the row's own `reference` (the facts the "
        "student holds), with that reference, as the data writes it, as the target.",
    )
    max_new_tokens: int = Field(
        48, ge=1, le=4096, description="`content: base`: the longest answer the base gives to a task prompt."
    )
    prefix_space: bool = Field(
        False,
        description="Write each task target after one space (' Argentina'), as the word stands inside a sentence: a "
        "byte-level BPE tokenizer (GPT-2, SmolLM2, Llama 3, Qwen) gives a word at the start of a turn another token "
        "than the same word after a space (tokenizers' `add_prefix_space`), and a short answer's facts live in the "
        "spelling the base read and wrote in sentences. Scorers strip the space. Any `content`; replay rows are "
        "left as they are.",
    )

    def key_fields(self) -> dict:
        """The section as content keys hash it: ``prefix_space`` only when on (the keys from before it stay)."""
        return self.model_dump(exclude=set() if self.prefix_space else {"prefix_space"})


class DataSpec(_Strict):
    """Where the prompts come from, which are held out, and the filters on the teacher's answers."""

    source: str = Field(description="JSONL file or glob of files, relative to the repository root or absolute.")
    id_field: str = Field("id", description="Field holding a stable item id (hash of the prompt when absent).")
    prompt_field: str = Field("prompt", description="Field holding the prompt text.")
    reference_field: str = Field("reference", description="Reference answer, used for held-out evaluation only.")
    category_field: str = Field("category", description="Field holding the item's category (for per-category results).")
    heldout: HeldoutSpec = HeldoutSpec()
    filters: FilterSpec = FilterSpec()
    decontamination: DecontaminationSpec = Field(
        DecontaminationSpec(),
        description="N-gram overlap of the distillation set with every gate suite's documents "
        "(blocking check on distillation_set): drop and count, or fail.",
    )
    replay: ReplaySpec | None = Field(
        None,
        description="General prompts answered by the base student (default), the teacher or a file, mixed into "
        "training at `share`: keeps what the student could do before (self-replay, any teacher).",
    )
    targets: TargetsSpec = Field(
        TargetsSpec(),
        description="Whose knowledge the training targets carry: the teacher's answers (default), or the student's "
        "base's own answers in the teacher's short form (`content: base`: keeps what the student knows).",
    )


class DatasetSpec(_Strict):
    """How the tokenized_dataset stage turns the distillation set into packed training rows.

    The rows are tokenized once with the student's tokenizer and stored as sharded Parquet;
    every setting here is part of the stage's content key (a change builds a new dataset).
    """

    template: Literal["auto", "chat", "plain"] = Field(
        "auto",
        description="auto: the student tokenizer's chat template when it has one, else plain "
        "`<bos> prompt completion <eos>`; chat: require the chat template; plain: never use it.",
    )
    train_on_prompt: bool = Field(
        False, description="Loss on every token (prompt included) instead of the completion/assistant tokens only."
    )
    packing: bool = Field(
        True,
        description="Best-fit-decreasing packing of several examples into rows of training.max_seq_len "
        "(position_ids restart per example, so attention never crosses examples); false: one example per row.",
    )
    padding: Literal["free", "longest", "max_length"] = Field(
        "free",
        description="How the trainer batches rows. free: a micro-batch's rows concatenated into one "
        "sequence, no padding (right for every attention kernel, flash-attention included); longest: pad to the "
        "longest row; max_length: pad every row to training.max_seq_len (static shapes).",
    )
    too_long: Literal["drop", "truncate"] = Field(
        "drop",
        description="Examples longer than training.max_seq_len: drop them, or keep their first "
        "max_seq_len tokens (dropped anyway if no completion token is left). Both are counted.",
    )
    shard_size_mb: float = Field(256.0, gt=0, le=65536, description="Target size of one Parquet shard (MiB).")
    validation_fraction: float = Field(
        0.02,
        ge=0.0,
        lt=1.0,
        description="Share of examples held out as a validation split, chosen by a seeded "
        "hash of the example id (never by packed row), so an example keeps its side across rebuilds.",
    )
    split_seed: int = Field(0, ge=0, description="Seed of the train/validation id hash.")
    extra_sources: list[str] = Field(
        default_factory=list,
        description="More prompt/completion (`prompt`, `completion`) or conversational "
        "(`messages`) data added to the distillation set: JSONL/JSON/Parquet/CSV files, globs, or directories "
        "saved with `Dataset.save_to_disk`; relative to the repository root. Optional `id` column.",
    )
    num_proc: int | None = Field(
        None,
        ge=1,
        le=512,
        description="Tokenizer processes (datasets `map` num_proc); default: every core, for "
        "inputs large enough to pay for the process start-up.",
    )
