"""Make PyMySQL logins fail the way MySQL 8 does without ``cryptography``.

With ``caching_sha2_password`` (MySQL 8's default) over plain TCP, the first
login after a server restart needs RSA; PyMySQL without its ``rsa`` extra
then raises a bare ``RuntimeError`` from ``pymysql._auth`` inside
``Connection.connect``, which SQLAlchemy does not wrap. :func:`install` wraps
``Connection._request_authentication`` so that, while :data:`BROKEN` is set,
every login runs PyMySQL's own RSA step with ``cryptography`` hidden: the
error, its text and its traceback are PyMySQL's. MariaDB does not offer
``caching_sha2_password``, so the real server cannot produce it itself.

``OUTBOXKIT_TEST_BROKEN_LOGIN=1`` in a child's environment, with this folder's
``sitecustomize`` on its ``PYTHONPATH`` (see :func:`sitecustomize_dir`), does
the same in a subprocess.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

BROKEN = threading.Event()
failures = 0
_lock = threading.Lock()


def install() -> Callable[[], None]:
    """Patch PyMySQL; the returned function undoes it."""
    import pymysql._auth as auth
    import pymysql.connections as connections

    original = connections.Connection._request_authentication

    def _request_authentication(self: Any) -> Any:
        global failures
        if BROKEN.is_set():
            with _lock:
                failures += 1
            saved = auth._have_cryptography
            auth._have_cryptography = False
            try:
                auth.sha2_rsa_encrypt(b"password", b"\x01" * 20, b"")
            finally:
                auth._have_cryptography = saved
        return original(self)

    connections.Connection._request_authentication = _request_authentication

    def undo() -> None:
        connections.Connection._request_authentication = original

    return undo


def sitecustomize_dir(tmp: Path) -> Path:
    """A folder holding a ``sitecustomize.py`` that breaks every login of the child."""
    folder = tmp / "broken-login-site"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import broken_login\n"
        "broken_login.install()\n"
        "broken_login.BROKEN.set()\n"
    )
    return folder
