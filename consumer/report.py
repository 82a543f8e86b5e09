"""The drain report: what became of the messages in flight when the drain began,
and what the exit commit left the group holding.

The poll loop counts the drain batch's outcomes into it, the offset commits
record the exit commit's; the drain writes it into the exit record. A module of
its own so that each of them imports it rather than one another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DrainReport"]


@dataclass
class DrainReport:
    batch_size: int = 0
    succeeded: int = 0
    failed: int = 0
    duplicate: int = 0
    unknown: int = 0
    released: int = 0
    committed: dict[str, int] = field(default_factory=dict)
    committed_messages: int = 0
    commit_error: str | None = None
