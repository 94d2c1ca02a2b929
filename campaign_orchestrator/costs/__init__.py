"""What campaigns cost. Pure Python, no Dagster.

catalog    dated prices with sources, from a versioned YAML file (no price lives in code), and the cost lines
           priced from them (quantity × unit price) that stages write into their manifests
ledger     the DuckDB ledger every stage output's lines are recorded in, once
report     cost per result ($/M teacher tokens, $/1k accepted examples, $/point gained)
memory     per-device memory of LoRA / QLoRA training (ZeRO / FSDP states, LoRA, activations, logits)
plan/      the planner: per-stage time and dollars before anything runs, with memory's figures (facts, roofline,
           stages, fit, scaleout, campaign, render)
budget     budget guards that stop a stage before it overspends
dashboard  the static HTML cost dashboard of a campaign
"""
