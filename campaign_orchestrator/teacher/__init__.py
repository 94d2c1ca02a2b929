"""The teacher as a service, built on :mod:`campaign_orchestrator.generation` (which holds the engines, the
cache and the runner every stage generates through).

- :mod:`campaign_orchestrator.teacher.server`: a local model behind an OpenAI-compatible HTTP server.
- :mod:`campaign_orchestrator.teacher.scoring`: the teacher scoring given text (on-policy distillation), in
  process or over HTTP (:mod:`campaign_orchestrator.teacher.scoring_http`).
- :mod:`tests.support.testserver`: a real OpenAI-compatible HTTP server for tests and benchmarks.
- ``python -m campaign_orchestrator.teacher``: the generation loop from the command line (and ``serve``).

Nothing here imports torch at module level or Dagster.
"""
