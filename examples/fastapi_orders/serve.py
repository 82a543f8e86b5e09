"""Serve the order service: ``python serve.py --port 8000``.

The same as ``uvicorn orders_app:app --port 8000``, except for the exit status.
uvicorn drains on SIGTERM/SIGINT and then re-raises the signal to the handler
that was installed before it started, so by default the process ends "killed
by SIGTERM" (status 143). The outboxkit processes beside it exit 0 after a
clean drain; with :func:`_exit_0` as that earlier handler, so does this one (and
a signal that arrives before uvicorn is serving simply ends it).
"""

from __future__ import annotations

import argparse
import signal
from types import FrameType

import uvicorn
from orders_app import app


def _exit_0(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (it is logged)")
    args = parser.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_0)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
