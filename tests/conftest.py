"""Shared pytest setup. Area fixtures live in tests/fixtures_*.py and are imported by the tests that use them."""
