"""The README's written-out signature of ``enqueue`` is the function's.

Its error table names ``max_message_bytes`` and ``max_payload_bytes``; a
signature that leaves them (or ``table``) out sends a reader to the source.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import outboxkit

README = Path(__file__).resolve().parents[2] / "README.md"


def written_signature(name: str) -> inspect.Signature:
    """The first inline-code ``name(...)`` of the README, as a signature."""
    text = " ".join(README.read_text().split())
    match = re.search(rf"`{name}\((conn_or_session, \*,[^`]*)\)`", text)
    assert match, f"README.md has no `{name}(conn_or_session, *, ...)`"
    tree = ast.parse(f"def {name}({match.group(1)}): pass")
    func = tree.body[0]
    assert isinstance(func, ast.FunctionDef)
    args = func.args
    params = [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in args.args]
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        value = inspect.Parameter.empty if default is None else ast.literal_eval(default)
        params.append(inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY, default=value))
    return inspect.Signature(params)


def test_the_readme_gives_enqueue_all_its_parameters_and_defaults() -> None:
    real = inspect.signature(outboxkit.enqueue)
    written = written_signature("enqueue")
    assert list(written.parameters)[1:] == list(real.parameters)[1:]
    for name, param in list(real.parameters.items())[1:]:
        assert written.parameters[name].default == param.default, name
