"""The local model engines, one module each, side by side behind one small interface.

Each engine is built over a :class:`~campaign_orchestrator.generation.local.LocalModel` (the loaded model,
its tokenizer, stop ids and batch settings) and answers rendered prompts (token ids)::

    engine.generate(enc, max_new_tokens, logprobs=None, progress=None, on_result=None) -> list[Completion]

greedily, in input order, every :class:`~campaign_orchestrator.generation.completion.Completion` the same
whichever engine ran: text, token ids (the stop token included), finish reason (``stop``, ``length``, or
``error`` for a prompt that does not fit the context), and the top-k log-probabilities of every generated
token when ``logprobs=k``. Class attributes say what an engine can do:

- ``top_logprobs``: it can return top-k log-probabilities (an engine that cannot is never chosen for a request
  that asks for them: transformers' ``generate_batch`` returns only the chosen token's log-probability);
- ``devices``: the device kinds it is a candidate on (``auto`` probes only those);
- :meth:`unavailable` says why it cannot run here (a missing API, a missing package), or ``None``.

- :mod:`.continuous`: the project's continuous greedy engine (forward + ``DynamicCache``, rows leave and join).
- :mod:`.hf_generate`: transformers' ``model.generate`` in length-sorted batches (also every sampled request).
- :mod:`.generate_batch`: transformers' continuous batching ``model.generate_batch`` (paged key/value cache).
- :mod:`.vllm_engine`: vLLM's offline ``LLM`` over the same checkpoint (its LoRA adapter as a ``LoRARequest``).

Which engine runs is chosen by measurement (:mod:`campaign_orchestrator.generation.auto`).
"""

from __future__ import annotations

ENGINE_MODULES = {
    "continuous": ("campaign_orchestrator.generation.engines.continuous", "ContinuousEngine"),
    "hf_generate": ("campaign_orchestrator.generation.engines.hf_generate", "HFGenerateEngine"),
    "generate_batch": ("campaign_orchestrator.generation.engines.generate_batch", "GenerateBatchEngine"),
    "vllm": ("campaign_orchestrator.generation.engines.vllm_engine", "VLLMEngine"),
}


def engine_class(name: str):
    """The engine class registered as ``name`` (imported on use: the engines import torch)."""
    import importlib

    module, cls = ENGINE_MODULES[name]
    return getattr(importlib.import_module(module), cls)
