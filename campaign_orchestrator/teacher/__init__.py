"""Teacher generation: three backends behind one interface, a content-addressed cache, the loop.

- :mod:`campaign_orchestrator.teacher.requests`: requests and their cache keys (teacher identity, sampling, prompt, sample index).
- :mod:`campaign_orchestrator.teacher.backends`: ``transformers`` (local batched), ``vllm`` (offline batch), ``openai`` (any
  OpenAI-compatible endpoint, :mod:`campaign_orchestrator.teacher.openai_client`).
- :mod:`campaign_orchestrator.teacher.cache`: shards on local disk or S3 (:mod:`campaign_orchestrator.teacher.blobstore`), spooled per row so a
  killed run loses only what was in flight.
- :mod:`campaign_orchestrator.teacher.runner`: the loop (cache lookup, generate what is missing, rows in prompt order).
- :mod:`campaign_orchestrator.teacher.rows`: the Parquet schema of the generation table, including ``top_logprobs``.
- :mod:`campaign_orchestrator.teacher.local`: batched generation with a local model (also used by evaluation).
- :mod:`tests.support.testserver`: a real OpenAI-compatible HTTP server for tests and benchmarks.
- ``python -m campaign_orchestrator.teacher``: the same loop from the command line.

Only :mod:`campaign_orchestrator.teacher.local` imports torch; nothing here imports Dagster.
"""
