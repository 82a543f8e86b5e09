"""The installed package pulls in what its databases need to log in."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.unit


def _requires(dist: str) -> list[Requirement]:
    return [Requirement(r) for r in md.requires(dist) or ()]


def test_mysql8_logins_work_with_a_plain_install() -> None:
    # MySQL 8's default caching_sha2_password needs RSA over plain TCP: PyMySQL's
    # "rsa" extra, which is what brings in cryptography.
    runtime = [r for r in _requires("outboxkit") if r.marker is None]
    [pymysql] = [r for r in runtime if r.name.lower() == "pymysql"]
    assert "rsa" in pymysql.extras
    rsa_extra = [
        r.name.lower()
        for r in _requires("PyMySQL")
        if r.marker is not None and r.marker.evaluate({"extra": "rsa"})
    ]
    assert "cryptography" in rsa_extra
    import pymysql._auth

    assert pymysql._auth._have_cryptography  # installed, so the login can encrypt


def _extra(name: str) -> list[Requirement]:
    return [r for r in _requires("outboxkit") if r.marker and r.marker.evaluate({"extra": name})]


def test_the_postgres_extra_brings_psycopg3_with_its_own_libpq() -> None:
    [psycopg] = [r for r in _extra("postgres") if r.name.lower() == "psycopg"]
    assert "binary" in psycopg.extras  # no compiler or libpq-dev on the machine
    assert psycopg.specifier.contains("3.2") and not psycopg.specifier.contains("3.1.9")
    # The dev install (and so CI) can run the PostgreSQL tests.
    assert any(r.name.lower() == "outboxkit" and "postgres" in r.extras for r in _extra("dev"))


def test_the_package_imports_without_psycopg() -> None:
    """PostgreSQL is optional: without the extra, every module still imports."""
    probe = (
        "import sys\n"
        "sys.modules['psycopg'] = None  # as if the extra were not installed\n"
        "import outboxkit, outboxkit.cli, outboxkit.schema, outboxkit.writer\n"
        "import outboxkit.relay, outboxkit.consumer, outboxkit.admin\n"
        "outboxkit.cli.build_parser()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
