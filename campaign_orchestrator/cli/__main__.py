"""``python -m campaign_orchestrator.cli``: the ``campaign`` command."""

from campaign_orchestrator.cli import main

raise SystemExit(main())
