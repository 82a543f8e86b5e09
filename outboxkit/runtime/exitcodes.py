"""Process exit codes, one per way a run can end, so operators can tell them apart."""

from __future__ import annotations

__all__ = ["EXIT_CONFIG", "EXIT_DEPENDENCY", "EXIT_FAILURE", "EXIT_FORCED", "EXIT_OK"]

EXIT_OK = 0
"""Clean drain: every piece of in-flight work was finished or released."""

EXIT_FAILURE = 1
"""Unexpected error (a bug); a drain was attempted before exiting."""

EXIT_CONFIG = 2
"""Bad settings or CLI input; the message names the setting."""

EXIT_DEPENDENCY = 3
"""A dependency was unreachable at start, or went away for good."""

EXIT_FORCED = 4
"""``shutdown_timeout`` passed: forced exit; the cut resources were logged."""
