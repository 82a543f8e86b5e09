"""Benchmarks: outboxkit next to the limits of the same machine, measured in one run.

``./bench/run.sh`` starts the local services and runs ``python -m bench``; see
``docs/performance.md`` for the scenarios, the latest figures and what they mean.
Figures are only compared within one run: on a small, shared machine the absolute
numbers move from run to run, the ratios much less.
"""

import os as _os
import sys as _sys

# ``python -m bench`` from the checkout puts its root first on sys.path, where the
# root's ``outboxkit/`` folder (the package root only, without relay/, consumer/
# and schema/, which the install maps from other folders) would shadow the
# installed package.  Moving the root to the end keeps ``bench`` importable and
# lets ``outboxkit`` come from the install.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_entries = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) == _root]
if _entries and "outboxkit" not in _sys.modules:
    _sys.path[:] = [p for p in _sys.path if p not in _entries] + [_root]
