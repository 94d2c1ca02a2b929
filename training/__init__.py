"""The trainer: ``python -m training --config FILE``, run under torchrun. No Dagster import.

It reads a :class:`training.config.TrainJob` (JSON), the pre-tokenized Parquet dataset, trains
LoRA/QLoRA adapters under FSDP2, writes a PEFT adapter directory, and reports back through
``dagster-pipes`` when launched by Dagster (global rank 0 only).
"""
