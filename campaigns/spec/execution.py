"""The ``execution:`` section: where the generation stages run (one process, or a Ray cluster).

The generation stages are the teacher's generations, the teacher scoring held-out items, and the
candidate's and base's answers in evaluation. ``engine: local`` (the default) runs each in the stage's
own process, as before. ``engine: ray`` splits a stage's prompts into shards by content hash and runs
them on an actor pool (one model replica per actor) of a Ray cluster: a local cluster the stage starts
when ``ray_address`` is empty, an existing one otherwise (on Kubernetes: a KubeRay cluster).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from campaigns.spec.common import _Strict


class ExecutionSpec(_Strict):
    """Where the generation stages run: `local` (one process, the default) or `ray` (shards on an actor pool)."""

    engine: Literal["local", "ray"] = Field(
        "local", description="local: each generation stage runs in its own process; ray: its prompts are split into "
                             "shards run by `replicas` actors of a Ray cluster, each holding one model replica.")
    ray_address: str | None = Field(
        None, description="The Ray cluster to use (`auto`, `host:6379` or `ray://host:10001`); empty: the stage starts "
                          "a local cluster with this machine's CPUs and stops it when done.")
    replicas: int = Field(2, ge=1, description="Actors (model replicas) in the pool; more than the cluster can place "
                                               "wait for room.")
    num_cpus_per_replica: float = Field(1.0, gt=0, description="CPUs Ray reserves for each replica (and the torch "
                                                               "threads it runs with).")
    num_gpus_per_replica: float = Field(0.0, ge=0, description="GPUs Ray reserves for each replica (0: CPU replicas).")
    shard_prompts: int = Field(64, ge=1, description="Prompts per shard: the unit that is cached, retried and billed "
                                                     "as one.")
    max_shard_retries: int = Field(3, ge=0, description="Times a shard lost with its worker is run again before the "
                                                        "stage fails.")
