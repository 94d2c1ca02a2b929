"""Generation: answers for many requests from any engine, cached by content, run here or on a Ray cluster.

The teacher stage, evaluation (candidate and base answers), drift scoring and on-policy sampling all generate
through this package.

- :mod:`.requests`: requests and their cache keys (teacher identity, sampling, prompt, sample index);
  :mod:`.completion`: what every engine returns for one request; :mod:`.rows`: the Parquet schema of the
  generation table, including ``top_logprobs``.
- The engines, one module each: :mod:`.local` (a local ``transformers`` model: the continuous engine and plain
  ``generate``), :mod:`.openai_client` (any OpenAI-compatible endpoint); :mod:`.backends` puts each behind one
  interface (``transformers``, ``vllm``, ``openai``) and :mod:`.recipes` rebuilds one from a picklable recipe.
- :mod:`.cache`: the content-addressed generation cache, shards on local disk or S3 (:mod:`.blobstore`).
- :mod:`.runner`: the loop (cache lookup, generate what is missing, rows in prompt order);
  :mod:`.scaleout`: the same stage on a Ray cluster (shards on an actor pool, resumable per shard).

Only the local engines import torch (lazily: import them inside the steps that use them); nothing here imports
Dagster. :mod:`campaign_orchestrator.teacher` sits above this package: the teacher's server, its scoring of given
text, and ``python -m campaign_orchestrator.teacher``.
"""
