"""Sphinx configuration: Markdown pages (myst-parser), the API from the docstrings (autodoc), and the
pages generated from the code by ``_ext/mixer_docs.py`` (the CLI, the config keys, the internals)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))  # the package from this checkout, installed or not

import mixer  # noqa: E402

project = "mixer"
author = "the mixer authors"
copyright = "the mixer authors"
release = version = getattr(mixer, "__version__", "0.1.0")

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "mixer_docs",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# No network at build time: no intersphinx. The docstrings' references into mixer must all resolve
# (nitpicky); what they say about other libraries' classes cannot, and is ignored below.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
nitpicky = True
nitpick_ignore_regex = (
    []
    if os.environ.get("MIXER_DOCS_NO_IGNORE")
    else [
        # Targets in other libraries (numpy, torch, the standard library, typing, yaml, ...): a dotted
        # name whose top-level package is not mixer. Names the code imports (``np.ndarray``, a class
        # imported for type checking only) reach here as their full names (``_ext/mixer_docs.py``).
        (r"py:.*", r"(?!mixer\.)[a-z_][a-z0-9_]*(\.\w+)+"),
    ]
)

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True

html_theme = "alabaster"
html_title = "mixer"
html_static_path: list[str] = []

# References in docstrings that name nothing in the package, to fix in the code (the module they are
# written in is part of the key, so a fix or a move makes the entry stale, and the build says so).
# They are listed at the end of every build, with the references that resolve only by a
# package-wide search (_build/unqualified-references.txt).
mixer_docs_known_dangling: set[tuple[str, str, str]] = set()

# Docstrings that are not valid reStructuredText yet, by qualified name, to fix in the code: their
# text is left out of the pages (the entry stays).
mixer_docs_unparsable = {
    "_parse_head": "an inline literal that ends in a space: ``{'descr': …, 'fortran_order': …, ``",
}
