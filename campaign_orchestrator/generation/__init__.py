"""Generation: answers for many requests from any engine, cached by content, run here or on a Ray cluster.

The teacher stage, evaluation (candidate and base answers), drift scoring and on-policy sampling all generate
through this package.

- :mod:`.requests`: requests and their cache keys (teacher identity, sampling, prompt, sample index);
  :mod:`.completion`: what every engine returns for one request; :mod:`.rows`: the Parquet schema of the
  generation table, including ``top_logprobs``.
- :mod:`.local`: the :class:`~.local.LocalModel` a local model answers with, over the engines of
  :mod:`.engines`, one module each (the continuous engine, ``generate``, transformers' ``generate_batch``, vLLM),
  ``auto`` choosing among them by a measured probe (:mod:`.auto`); :mod:`.openai_client`: any OpenAI-compatible
  endpoint. :mod:`.backends` puts them behind one interface (``transformers``, ``vllm``, ``openai``) and
  :mod:`.factories` rebuilds one in another process from a picklable factory.
- :mod:`.cache`: the content-addressed generation cache, shards on local disk or S3 (:mod:`.blobstore`).
- :mod:`.runner`: :func:`~.runner.run_generation`, the one loop (cache lookup, generate what is missing, rows in
  prompt order) with an executor plugged in: :class:`~.runner.LocalExecutor` (a backend in this process) or
  :class:`~.scaleout.stage.RayExecutor` (:mod:`.scaleout`: the missing requests as shards on an actor pool,
  resumable per shard).

Only the local engines import torch (lazily: import them inside the steps that use them); nothing here imports
Dagster. :mod:`campaign_orchestrator.teacher` sits above this package: the teacher's server, its scoring of given
text, and ``python -m campaign_orchestrator.teacher``.
"""
