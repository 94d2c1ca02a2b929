"""Cluster validation with no Dagster import: collective bandwidth sweeps, the validation ladder's
rungs, and baselines that catch regressions.

* :mod:`training.cluster.collectives` all_reduce / all_gather / reduce_scatter sweep (nccl-tests algbw and busbw).
* :mod:`training.cluster.smoke`       environment smoke and distributed gradient-equality smoke.
* :mod:`training.cluster.ladder`      the rungs' plain logic (tiny training, gate).
* :mod:`training.cluster.baseline`    store a rung's numbers; compare a new run against them, naming what moved.
* :mod:`training.cluster.torchrun`    run a module under torchrun on this machine (one or several "nodes").

Profiler-trace triage and profile upload live beside the profiler, in :mod:`training.triage` and
:mod:`training.publish`.
"""
