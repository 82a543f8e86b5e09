"""The installed package pulls in what its databases need to log in."""

from __future__ import annotations

import importlib.metadata as md

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
