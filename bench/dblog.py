"""What the database writes to its replication log: the binary log of MariaDB and
MySQL (when ``log_bin`` is on) or PostgreSQL's WAL.

Production MySQL and MariaDB run with the binary log on (replication, backups,
point-in-time recovery), in row format with full row images, and every row
change is written there once more: the bytes a phase adds to the log are a
cost of that phase as real as its CPU. Read before and after a phase; the
difference is what the phase logged (the server's, so nothing else may write
meanwhile: a benchmark run has the database to itself).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
import tenacity


def log_bytes(engine: sa.Engine) -> int | None:
    """The log's size so far, in bytes; None when the server keeps no such log
    (MariaDB/MySQL with the binary log off)."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            return int(
                conn.execute(sa.text("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")).scalar_one()
            )
        if not int(conn.execute(sa.text("SELECT @@log_bin")).scalar_one()):
            return None
        return sum(int(row[1]) for row in conn.execute(sa.text("SHOW BINARY LOGS")))


def purge_old_logs(engine: sa.Engine, *, wait_s: float = 10.0) -> list[str]:
    """Drop the binary log files before the current one (MariaDB/MySQL with the
    binary log on; nothing elsewhere: PostgreSQL recycles its WAL itself), and
    return the files left.

    A benchmark run writes gigabytes of row images, and a bench instance has no
    replica to keep them for: run after run, they filled the disk. Called
    between scenarios, never inside one: a phase's log bytes are a difference
    of :func:`log_bytes` read within its scenario.

    MariaDB keeps a file until its binlog checkpoint has passed it, which its
    background thread writes a moment after the commits in it are durable:
    ``PURGE`` right after a burst of writes or a ``FLUSH BINARY LOGS`` silently
    keeps the file (measured: most rounds on a busy machine). So the purge is
    repeated until only the file being written is left, for up to ``wait_s``;
    a file still kept then is left for the next call."""
    if engine.dialect.name == "postgresql":
        return []
    with engine.connect() as conn:
        if not int(conn.execute(sa.text("SELECT @@log_bin")).scalar_one()):
            return []

    @tenacity.retry(
        stop=tenacity.stop_after_delay(wait_s),
        wait=tenacity.wait_exponential(multiplier=0.02, max=0.5),
        retry=tenacity.retry_if_result(lambda files: len(files) > 1),
        retry_error_callback=lambda state: state.outcome.result() if state.outcome else [],
    )
    def purge() -> list[str]:
        with engine.connect() as conn:
            files = [str(row[0]) for row in conn.execute(sa.text("SHOW BINARY LOGS"))]
            if len(files) > 1:  # the last one is the file being written
                conn.execute(sa.text("PURGE BINARY LOGS TO :current"), {"current": files[-1]})
                files = [str(row[0]) for row in conn.execute(sa.text("SHOW BINARY LOGS"))]
            return files

    files: list[str] = purge()
    return files


def log_settings(engine: sa.Engine) -> dict[str, Any]:
    """How the server logs row changes (reported beside every figure)."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            level, full_pages = conn.execute(
                sa.text("SELECT current_setting('wal_level'), current_setting('full_page_writes')")
            ).one()
            return {"log": "wal", "wal_level": str(level), "full_page_writes": str(full_pages)}
        on, fmt, image = conn.execute(
            sa.text("SELECT @@log_bin, @@binlog_format, @@binlog_row_image")
        ).one()
    if not int(on):
        return {"log": "none", "log_bin": "OFF"}
    return {"log": "binlog", "log_bin": "ON", "binlog_format": fmt, "binlog_row_image": image}


class LogMeter:
    """Bytes logged between :meth:`begin` and :meth:`bytes` (None without a log)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.start: int | None = None

    def begin(self) -> LogMeter:
        self.start = log_bytes(self.engine)
        return self

    def bytes(self) -> int | None:
        if self.start is None:
            return None
        now = log_bytes(self.engine)
        return None if now is None else now - self.start
