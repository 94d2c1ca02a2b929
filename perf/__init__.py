"""Performance tooling with no Dagster import: profiler-trace triage, collective bandwidth sweeps,
the cluster validation ladder's rungs, and baselines that catch regressions.

* :mod:`perf.triage`      read Chrome traces (torch.profiler), split step time per rank, name the bottleneck.
* :mod:`perf.collectives` all_reduce / all_gather / reduce_scatter sweep (nccl-tests algbw and busbw).
* :mod:`perf.smoke`       environment smoke and distributed gradient-equality smoke.
* :mod:`perf.baseline`    store a rung's numbers; compare a new run against them, naming what moved.
* :mod:`perf.launch`      run a module under torchrun on this machine (one or several "nodes").
* :mod:`perf.publish`     copy a run's profile directory to S3.
"""
