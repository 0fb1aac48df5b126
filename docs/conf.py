"""Sphinx configuration of the optax-gwt documentation (MyST Markdown pages, API from the docstrings).

Build (no network needed): ``python -m sphinx -W -b html docs docs/_build/html``.
"""

from __future__ import annotations

import inspect
import os
import sys

from sphinx.pycode import ModuleAnalyzer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the checkout's optax_gwt, also when it is not installed

import optax_gwt  # noqa: E402

project = "optax-gwt"
author = "the optax-gwt authors"
copyright = "2026, the optax-gwt authors"
release = version = optax_gwt.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",  # [source] links to the highlighted code of each entry
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: ::: fences, $...$ math, anchors for ## and ### headings (links like page.md#a-section).
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

# The docstrings are Google style; `name` in them is a cross-reference where Sphinx finds it.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
default_role = "py:obj"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options: dict = {}  # members are asked for where wanted
napoleon_use_ivar = True  # Attributes: as fields, not entries that would double autodoc's
# Optax's type aliases as written in the signatures, not expanded into their unions.
_OPTAX_ALIASES = ("optax.ScalarOrSchedule", "optax.Schedule", "optax.OptState", "optax.Updates", "optax.Params")
autodoc_type_aliases = {name: name for name in _OPTAX_ALIASES}
# The levanter extra's packages, absent from the docs environment: optax_gwt.levanter's pages are read from its source.
autodoc_mock_imports = ["levanter", "haliax", "equinox"]
autosummary_generate = False  # the tables link to the entries on the same page; nothing is generated
add_module_names = True

# No network: no intersphinx; MathJax is the theme's bundled default URL, loaded by the reader's browser.
html_theme = "sphinx_book_theme"
html_title = f"optax-gwt {release}"
html_static_path = ["_static"]
html_css_files = ["tables.css"]  # wide tables scroll, short cells do not wrap
html_js_files = ["tables.js"]
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
html_last_updated_fmt = None


def _constant_doc(app, what, name, obj, options, lines: list[str]) -> None:
    """A constant re-exported at the top (``optax_gwt.STATIC_ARGS``) gets its ``#:`` comment, never its type's doc."""
    if what != "data" or not type(obj).__doc__ or inspect.getdoc(obj) != inspect.getdoc(type(obj)):
        return
    short = name.rsplit(".", 1)[-1]
    for modname, module in sorted(sys.modules.items()):
        if modname.startswith("optax_gwt") and getattr(module, short, None) is obj:
            doc = ModuleAnalyzer.for_module(modname).find_attr_docs().get(("", short))
            if doc:
                lines[:] = list(doc)
                return
    lines[:] = []


def _skip_tuple_fields(app, what, name, obj, skip, options):
    """NamedTuple fields: their docstrings say "Alias for field number 0"; the class's Attributes describe them."""
    if what == "class" and (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _skip_tuple_fields)
    app.connect("autodoc-process-docstring", _constant_doc, priority=300)
