"""Helpers shared by the test suites (not part of the installed package)."""
