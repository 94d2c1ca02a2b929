"""The planner: before anything runs, does the student fit its GPUs, and what will each stage cost?

One module per concern, in the order a plan is made:

- ``facts``: what the campaign's data says (prompt counts, mean prompt lengths in each model's tokens, suite
  sizes): :class:`~campaign_orchestrator.costs.plan.facts.DataFacts`;
- ``roofline``: time and money of training steps and generation on a catalog entry (the model below);
- ``stages``: each stage's estimate (teacher generations, the student's training and its on-policy part, the
  sweep, evaluation): dataclasses of :mod:`~campaign_orchestrator.costs.plan.stages`;
- ``fit``: per-device memory and whether it fits (:mod:`campaign_orchestrator.costs.memory` counts the bytes);
- ``scaleout``: the teacher stage on 1..N Ray replicas (``execution.executor: ray``, ``campaign plan --replicas``);
- ``campaign``: the whole :class:`~campaign_orchestrator.costs.plan.campaign.Plan`;
- ``render``: the plan as ``campaign plan`` prints it.

Time: a roofline with fixed overheads, from the catalog's ``perf`` block of the hardware:
training FLOPs = 4·Ψ per token (forward 2Ψ, backward through a frozen base 2Ψ; +2Ψ when
activations are recomputed; Ψ the decoder's *active* parameters, those of a mixture of experts' k of E
experts), plus 4·V·h for the LM head at the labelled positions only (the trainer scores no prompt
position: ``training.head``), over ``world × peak × mfu``, plus ``step_overhead_s`` per optimizer
step and ``train_startup_s``. Generation = max(compute, weight reads per decode step over the
memory bandwidth) plus ``decode_step_overhead_s`` per decode step and ``generate_startup_s``; a
batch decodes to each answer's length where rows leave as they finish (vLLM; greedy local requests on the
continuous engine) and to its longest (``max_new_tokens``) where every row computes until the last one
stops (sampled local requests on ``generate``: :func:`~campaign_orchestrator.costs.plan.roofline.decode_length`);
the billed tokens and the training examples count the mean answer (``completion_fill`` × ``max_new_tokens``).
The teacher is priced by its one price field (``costs.catalog.teacher_entry``: ``teacher.price`` per
token for an API, which has no time estimate; ``teacher.hardware`` per hour for a self-hosted one), the
field the budget guard and the recorded cost read; ``price: unpriced`` makes every estimate that
depends on it ``None`` (shown "unknown").

Pure Python; reads model ``config.json`` and ``tokenizer.json`` with the ``tokenizers`` library.
"""
