"""Make the checkout's ``bench`` package importable for the smoke test.

Appended, not prepended: the checkout's root also holds ``outboxkit/`` (the
package root only), which must not shadow the installed package.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.append(ROOT)
