"""Test helpers, imported one way: ``from tests.support.<module> import ...``; fixtures live in
``tests/conftest.py``."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout the tests run from (tests are never installed)
