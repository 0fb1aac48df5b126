"""Sphinx configuration of the optax-gwt documentation (MyST Markdown pages, API from the docstrings).

Build (no network needed): ``python -m sphinx -W -b html docs docs/_build/html``.
"""

from __future__ import annotations

import inspect
import os
import re
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
autosummary_generate = False  # the tables link to the entries on the same page; nothing is generated
add_module_names = True

# No network: no intersphinx; MathJax is the theme's bundled default URL, loaded by the reader's browser.
html_theme = "sphinx_book_theme"
html_title = f"optax-gwt {release}"
html_static_path = ["_static"]
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
html_last_updated_fmt = None


# The docstrings are written to read well as plain text as well as in Sphinx. Three of their
# idioms are not valid reStructuredText; they are rewritten here, only in what Sphinx reads
# (the sources stay as they are, and a docstring already valid passes through unchanged):
#   `name`s               a plural after a reference  ->  `name`\ s
#   ``b -> ``             a space before the closing ``  ->  ``b ->``
#   level, wavelet,       one Args entry for several names, its name list
#     mode: see ...       wrapped over lines  ->  joined into one line
_INLINE = re.compile(r"``.+?``|`[^`]+`")  # literals and references, paired left to right
_NAME_LIST = re.compile(r"^(\s+)\w+(?:, \w+)*,$")


def _inline(match: re.Match) -> str:
    token = match.group(0)
    if token.startswith("``"):
        token = "``" + token[2:-2].strip() + "``"
    after = match.string[match.end() : match.end() + 1]
    return token + ("\\ " if after.isalnum() else "")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _rst_friendly(app, what, name, obj, options, lines: list[str]) -> None:
    out: list[str] = []
    literal_above = None  # the indentation of the line ending in "::" while in its literal block
    for line in lines:
        if literal_above is not None and line.strip() and _indent(line) <= literal_above:
            literal_above = None
        if literal_above is None and not line.lstrip().startswith(">>>"):
            line = _INLINE.sub(_inline, line)
        if line.rstrip().endswith("::"):
            literal_above = _indent(line)
        names = _NAME_LIST.match(out[-1]) if out else None
        if names and line.strip() and _indent(line) == len(names.group(1)):
            out[-1] = out[-1] + " " + line.strip()  # the name list goes on
            continue
        out.append(line)
    lines[:] = _split_attribute_groups(out)


_SECTION = re.compile(r"^\s*(\w[\w ]*):$")
_GROUP = re.compile(r"^(\s+)(\w+(?:, \w+)+): (.*)$")


def _split_attribute_groups(lines: list[str]) -> list[str]:
    """``a, b: what`` under Attributes: napoleon takes it for one attribute; one entry per name instead."""
    out: list[str] = []
    section, i = None, 0
    while i < len(lines):
        line = lines[i]
        header = _SECTION.match(line)
        if header and not line.startswith((" ", "\t")):
            section = header.group(1)
        group = _GROUP.match(line) if section == "Attributes" else None
        if not group:
            out.append(line)
            i += 1
            continue
        indent, names, first = group.groups()
        body = [first]
        i += 1
        while i < len(lines) and lines[i].strip() and _indent(lines[i]) > len(indent):
            body.append(lines[i].strip())
            i += 1
        for name in names.split(", "):
            out.append(f"{indent}{name}: " + " ".join(body))
    return out


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
    app.connect("autodoc-process-docstring", _rst_friendly, priority=400)  # before napoleon (500)
    app.connect("autodoc-process-docstring", _constant_doc, priority=300)
