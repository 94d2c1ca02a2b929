"""sweep_trial: one dynamic partition per trial of a campaign's sweep (``trial-000``, ...), not materialized by
Dagster itself: ``hparam_sweep`` reports a materialization of a trial's partition after every rung (its
parameters, eval loss at each rung, cost, and PROMOTED / PRUNED / COMPLETE / STOPPED). README, "Sweeps"."""

from dagster import AssetKey, AssetSpec, DynamicPartitionsDefinition

from assets.common import key
from campaigns.spec import CampaignSpec
from stages.hparam_sweep import trial_partition  # noqa: F401 - a trial's partition name, the stage's

TRIAL = "sweep_trial"


def trial_partitions(spec: CampaignSpec) -> DynamicPartitionsDefinition:
    return DynamicPartitionsDefinition(name=f"{spec.name}_sweep_trials")


def trial_key(spec: CampaignSpec) -> AssetKey:
    return key(spec, TRIAL)


def build(spec: CampaignSpec) -> AssetSpec:
    return AssetSpec(
        key=trial_key(spec),
        group_name=spec.name,
        partitions_def=trial_partitions(spec),
        deps=[key(spec, "tokenized_dataset")],
        kinds={"optuna"},
        description="One partition per sweep trial (reported by hparam_sweep after every rung): its "
        "parameters, eval loss at each rung, cost, and PROMOTED / PRUNED / COMPLETE / STOPPED.",
    )
