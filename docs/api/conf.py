"""Sphinx configuration of the API reference (docs/api), built from the docstrings.

Build: ``python -m sphinx -W --keep-going -b html docs/api <out>`` (the suite runs
exactly that, tests/docs/test_api_reference.py). The package is imported from the
environment, so build from one where outboxkit is installed (``pip install -e
'.[docs]'``).
"""

from importlib.metadata import version as _version

project = "outboxkit"
copyright = "the outboxkit authors"
release = _version("outboxkit")
version = release

extensions = ["sphinx.ext.autodoc"]

# Members in the order the source gives them (the order the module reads in),
# type hints in the signature, and only what __all__ lists.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# A class attribute that overrides a library's (SQLAlchemy's ``inherit_cache``)
# must not bring that library's docstring, and its cross-references, along.
autodoc_inherit_docstrings = False
autodoc_default_options = {"members": True, "show-inheritance": True}

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = f"outboxkit {release} API reference"
