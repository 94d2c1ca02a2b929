"""Generation stages on a Ray cluster (``execution.executor: ray``): shards on an actor pool, resumable per shard.

A stage's distinct requests are split into **shards by content hash** (:mod:`.shards`: the requests sorted by
key, cut every ``execution.shard_prompts``; a shard's id hashes its request keys, so a re-run of the same
prompts forms the same shards). A pool of ``execution.replicas`` Ray actors (:mod:`.worker`), each reserving
``num_cpus_per_replica`` / ``num_gpus_per_replica`` and holding one model replica built once from a picklable
recipe (:mod:`campaign_orchestrator.generation.factories`), takes shards one at a time (:mod:`.pool`).

**The cache is the one source of truth.** Each actor owns a writer of the content-addressed generation cache
(:mod:`campaign_orchestrator.generation.cache`): every finished generation goes to its spool at once (flushed
per row, so it survives the actor's death), and a shard is sealed as one Parquet file of the cache when it
finishes. Before a shard runs, its keys are looked up: a finished shard is never regenerated; a shard lost
with its worker (actor killed, node lost) is run again, on another actor, for the keys the cache still lacks
once the dead worker's spool is sealed, so only the prompts that were in flight are asked again. The driver
then reads every row from the cache.

**Why plain Ray actors, not Ray Data's ``map_batches``.** Ray Data fits a batch function whose output is its
return value: a block's rows come back when the whole block is done, a failed block is retried inside Ray Data
(all of it, on an actor it picks), and the driver sees neither which actor failed nor anything before the block
ends. The stage needs more, per prompt and while a shard runs: each finished generation durable in the cache
at once (so a lost shard costs only its in-flight prompts), the budget guard charged as each generation
finishes (summed over workers, to stop the whole job within one chunk per worker of the limit), progress
(shards done/total, tokens/s, dollars) streamed to the run log, a retry budget per shard, and a failure that
names the shard, the worker (node and actor) and the reason. An actor pool driven with ``ray.wait`` gives all
of that with Ray's own scheduling, placement (CPUs/GPUs per replica, any node of the cluster) and fault
detection; Ray Data would add its block and streaming-executor overhead to a job whose unit is already a shard.

**Shared rate limits.** An endpoint teacher's ``requests_per_minute`` / ``tokens_per_minute`` are one pair of
token buckets for the whole job: a named Ray actor (:mod:`.ratelimit`) every worker's client reserves from,
not one bucket per worker.

Nothing here imports torch or ray at module level: ``ray`` is imported inside the functions that use it.
The entry point a KubeRay ``RayJob`` runs inside the cluster is ``python -m campaign_orchestrator.generation.scaleout
--job JOB.json`` (:mod:`.__main__`).
"""
