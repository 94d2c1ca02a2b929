"""The teacher generation table: one row per (prompt, sample), written as Parquet.

Columns (``GENERATION_SCHEMA``):

- ``id`` (string): the prompt id; ``sample_index`` (int32): 0..n-1.
- ``prompt`` (string): the prompt text (for chat requests, the user message).
- ``completion`` (string): the generated text, stop token not included.
- ``finish_reason`` (string): ``stop`` (EOS or a stop sequence), ``length`` (hit
  ``max_new_tokens``: the completion is truncated) or ``error`` (no completion; see ``error``).
- ``prompt_tokens``, ``completion_tokens`` (int32, null when an HTTP endpoint reports no
  usage): token counts as the teacher counted them; ``completion_tokens`` includes the stop token.
- ``latency_s`` (float64): seconds the request took (the whole batch for batched backends).
- ``backend``, ``model``: the teacher backend and model reference from the campaign.
- ``sampling_hash`` (string): :func:`campaign_orchestrator.generation.requests.sampling_hash` of the parameters.
- ``request_key`` (string): the content-addressed cache key of this sample.
- ``from_cache`` (bool): true when this run found the sample in the cache (nothing paid).
- ``retries`` (int32): HTTP attempts beyond the first (429, 5xx, timeouts).
- ``error`` (string, null when fine): why the request produced nothing.
- ``completion_token_ids`` (list<int32>, null for HTTP backends): the generated ids, stop
  token included.
- ``top_logprobs``: null unless ``teacher.sampling.logprobs = k`` was set; then
  ``list<list<struct<token_id: int32, token: string, logprob: float32>>>`` with **one inner list
  per generated token** (``completion_tokens`` of them, the stop token included when
  ``finish_reason`` is ``stop``), each holding the teacher's ``k`` most likely next tokens at that
  position, most likely first, with their natural-log probabilities under the unmodified
  model distribution (temperature 1, before top-p). Local backends (``transformers``,
  ``vllm``) set ``token_id`` (ids of the teacher's tokenizer) and may leave ``token`` null;
  HTTP backends (``openai``) only know the token's text: ``token`` is set and ``token_id`` is
  null. A token that is not whole UTF-8 on its own (a byte-level token holding part of a character) is written
  ``bytes:\\xNN...`` (``campaign_orchestrator.dataset.xtok.token_string``).
- ``completion_token_strings`` (list<string>, null for local backends and without ``logprobs``): an HTTP
  teacher's generated tokens as text, one per top-k list, written like ``token``; with the completion text
  they give each position's byte offsets, so a student with another tokenizer is aligned by bytes
  (``campaign_orchestrator.dataset.xtok``). Local teachers' ids go through their tokenizer instead.
- ``teacher`` (string, null with one teacher): the name of the teacher that answered the row, when ``teacher:``
  is a list of teachers routed by category (older files lack the column: read as null).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

LOGPROB_STRUCT = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())])
TOP_LOGPROBS_TYPE = pa.list_(pa.list_(LOGPROB_STRUCT))

GENERATION_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("sample_index", pa.int32()),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("latency_s", pa.float64()),
        ("backend", pa.string()),
        ("model", pa.string()),
        ("sampling_hash", pa.string()),
        ("request_key", pa.string()),
        ("from_cache", pa.bool_()),
        ("retries", pa.int32()),
        ("error", pa.string()),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("top_logprobs", TOP_LOGPROBS_TYPE),
        ("completion_token_strings", pa.list_(pa.string())),
        ("teacher", pa.string()),
    ]
)


def logprobs_to_arrow(top: list | None) -> list | None:
    """``[[(token_id, token, logprob), ...], ...]`` (the backends' form) as struct dicts."""
    if top is None:
        return None
    return [
        [{"token_id": e[0], "token": e[1], "logprob": e[2]} if not isinstance(e, dict) else e for e in pos]
        for pos in top
    ]


def write_generations(rows: list[dict], path: str | Path) -> Path:
    rows = [r | {"top_logprobs": logprobs_to_arrow(r.get("top_logprobs"))} for r in rows]
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA), path)
    return Path(path)


def read_generations(path: str | Path, columns: list[str] | None = None) -> list[dict]:
    return pq.read_table(path, columns=columns).to_pylist()
