"""``python -m campaign_app.cli``: the ``campaign`` command."""

from campaign_app.cli import main

raise SystemExit(main())
