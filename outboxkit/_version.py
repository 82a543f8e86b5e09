"""The package's version, from one source: the installed distribution's metadata.

``pyproject.toml``'s ``version`` is the only place a version is written; an
installed package (a wheel, ``pip install .`` or ``pip install -e .``) carries it in
its metadata, and ``outboxkit.__version__``, ``outboxkit --version``, ``schema
apply``'s record in ``outboxkit_meta`` and ``admin status`` all read it from there.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

#: What a copy of the sources that was never installed reports (on ``sys.path`` by
#: hand): a valid version (PEP 440) that sorts before every release, so nothing
#: mistakes it for one.
UNKNOWN_VERSION = "0+unknown"


def package_version() -> str:
    """The installed outboxkit's version, or ``UNKNOWN_VERSION`` when not installed."""
    try:
        return version("outboxkit")
    except PackageNotFoundError:
        return UNKNOWN_VERSION


__version__ = package_version()
