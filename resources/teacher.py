"""The ``teacher`` resource: how this deployment runs every campaign's teacher (``vllm_chunk_size``). The backend
itself is chosen in the campaign spec and built by the stages (``stages/teacher.py``: ``transformers`` runs a local
checkpoint, ``vllm`` offline batch inference on this machine's GPUs, ``openai`` any OpenAI-compatible endpoint, its
API key read from the environment variable the spec names)."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field


class TeacherResource(ConfigurableResource):
    """Settings for the teacher backends the stages build."""

    vllm_chunk_size: int | None = Field(
        None, description="Prompts per vllm.LLM.generate call (a cache checkpoint); default: the spec's batch_size."
    )
