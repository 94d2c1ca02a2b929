"""Cost lines: what one stage spent, in a unit with a dated unit price.

The functions live in ``campaign_orchestrator/costs/catalog.py``, beside the entries they price (billing a
stage, ``stage_bill``, then stays in one module); this module keeps their names for the planner and tests.
"""

from campaign_orchestrator.costs.catalog import (  # noqa: F401
    TIERS, billed_hardware, compute_line, gpu_priced, price_problems, stage_bill, teacher_entry, teacher_lines,
    token_lines, total, usage_lines)
