"""Dagster resources: where artifacts live, who generates, who trains, what things cost.

Swapping local for cloud is a resource choice, never an asset change. Resources import
nothing heavy at module level: torch and friends load inside the methods that need them.
"""

from resources.local_launcher import LocalTorchrunLauncher
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from resources.teacher import TeacherResource

__all__ = ["ArtifactStore", "LocalTorchrunLauncher", "PricingResource", "TeacherResource"]
