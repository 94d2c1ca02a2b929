"""Cluster validation with no Dagster import: collective bandwidth sweeps, the validation ladder's
rungs, and baselines that catch regressions.

* :mod:`campaign_orchestrator.cluster.collectives` all_reduce / all_gather / reduce_scatter sweep (nccl-tests algbw and busbw).
* :mod:`campaign_orchestrator.cluster.smoke`       environment smoke and distributed gradient-equality smoke.
* :mod:`campaign_orchestrator.cluster.ladder`      the rungs' plain logic (tiny training, gate).
* :mod:`campaign_orchestrator.cluster.baseline`    store a rung's numbers; compare a new run against them, naming what moved.
* :mod:`campaign_orchestrator.cluster.torchrun`    run a module under torchrun on this machine (one or several "nodes").

Profiler-trace triage and profile upload live beside the profiler, in :mod:`training.triage` and
:mod:`training.publish`.
"""
