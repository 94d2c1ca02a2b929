"""Teacher generation: three backends behind one interface, a content-addressed cache, the loop.

- :mod:`generation.requests`: requests and their cache keys (teacher identity, sampling, prompt, sample index).
- :mod:`generation.backends`: ``transformers`` (local batched), ``vllm`` (offline batch), ``openai`` (any
  OpenAI-compatible endpoint, :mod:`generation.openai_client`).
- :mod:`generation.cache`: shards on local disk or S3 (:mod:`generation.blobstore`), spooled per row so a
  killed run loses only what was in flight.
- :mod:`generation.runner`: the loop (cache lookup, generate what is missing, rows in prompt order).
- :mod:`generation.rows`: the Parquet schema of the generation table, including ``top_logprobs``.
- :mod:`generation.local`: batched generation with a local model (also used by evaluation).
- :mod:`generation.testserver`: a real OpenAI-compatible HTTP server for tests and benchmarks.
- ``python -m generation``: the same loop from the command line.

Only :mod:`generation.local` imports torch; nothing here imports Dagster.
"""
