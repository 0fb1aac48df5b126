"""The built site: the API reference renders the docstrings as written, without stray markup.

The docstrings are read by ``help()`` and by Sphinx (autodoc + napoleon) alike, so they
must be valid reStructuredText as written: nothing rewrites them at build time.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest

import optax_gwt
from markdown_blocks import DOCS

# A double backquote, a backquote or a role marker left in the text, or a backslash escape.
_STRAY = re.compile(r"``|`|:[a-z]+:(?=`)|\\[a-z]")


class _ProseText(HTMLParser):
    """The text of a page outside code, literals, maths, scripts and styles; and the inline literals' text."""

    _CODE = {"pre", "code", "script", "style", "kbd", "tt"}

    def __init__(self) -> None:
        super().__init__()
        self.open: list[tuple[str, bool]] = []  # (tag, whether it starts a code region)
        self.prose: list[str] = []
        self.literals: list[str] = []

    def _in_code(self) -> bool:
        return any(code for _, code in self.open)

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "hr", "meta", "link", "input", "wbr"):
            return
        classes = (dict(attrs).get("class") or "").split()
        code = tag in self._CODE or "math" in classes or any(c.startswith("highlight") for c in classes)
        self.open.append((tag, code))

    def handle_endtag(self, tag):
        while self.open:
            if self.open.pop()[0] == tag:
                break

    def handle_data(self, data):
        if not self._in_code():
            self.prose.append(data)
        elif not any(tag == "pre" for tag, _ in self.open):  # an inline literal, not a code block
            self.literals.append(data)


def _stray_markup(html: str) -> list[str]:
    page = _ProseText()
    page.feed(html)
    prose = "".join(page.prose)
    found = [prose[max(0, m.start() - 50) : m.end() + 30] for m in _STRAY.finditer(prose)]
    # A literal whose text holds a double backquote was closed or opened in the wrong place.
    return found + [lit for lit in page.literals if "``" in lit and "<" not in lit]


def test_detector_finds_broken_markup():
    broken = '<p>update <code class="literal"><span class="pre">U</span></code>``in the dtype, where w``</p>'
    assert _stray_markup(broken)
    assert _stray_markup("<p>the params, or their `jax.ShapeDtypeStruct`s</p>")
    assert _stray_markup('<p>a literal <code class="literal"><span class="pre">a``b</span></code></p>')
    clean = '<p>fine <code class="literal"><span class="pre">a</span></code> text</p><pre>``x`` in code</pre>'
    assert _stray_markup(clean) == []


@pytest.mark.slow
def test_api_pages_render_without_stray_markup(tmp_path):
    """Build the site (no ``-W``, to see everything) and read the API pages' text.

    ``OPTAX_GWT_BUILT_DOCS`` names a site built from this checkout just before (CI builds it
    with ``-W`` first, so its docstrings gave no warning): its pages are read instead.
    """
    out = pathlib.Path(os.environ.get("OPTAX_GWT_BUILT_DOCS", "") or tmp_path / "html")
    if "OPTAX_GWT_BUILT_DOCS" not in os.environ:
        if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_parser") is None:
            pytest.skip('the docs extra is not installed: pip install -e ".[docs]"')
        build = subprocess.run(
            [sys.executable, "-m", "sphinx", "-E", "-q", "-b", "html", DOCS, str(out)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert build.returncode == 0, build.stderr
        docstring_warnings = [line for line in build.stderr.splitlines() if "docstring of" in line]
        assert not docstring_warnings, "\n".join(docstring_warnings)
    pages = sorted((out / "api").glob("*.html"))
    assert pages
    stray = {page.name: _stray_markup(page.read_text()) for page in pages}
    assert not any(stray.values()), stray


def _conf_docstring_hooks() -> list:
    """The ``autodoc-process-docstring`` handlers that docs/conf.py's ``setup`` connects."""
    spec = importlib.util.spec_from_file_location("docs_conf", os.path.join(DOCS, "conf.py"))
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    hooks: list = []

    class App:
        def connect(self, event, handler, priority=500):
            if event == "autodoc-process-docstring":
                hooks.append(handler)

    conf.setup(App())
    return hooks


def test_site_reads_the_docstrings_that_help_shows():
    """No build hook rewrites a public function's or class's docstring: the site's text is ``help()``'s."""
    pytest.importorskip("sphinx")
    hooks = _conf_docstring_hooks()
    objects = [getattr(optax_gwt, name) for name in optax_gwt.__all__]
    objects = [o for o in objects if inspect.isfunction(o) or inspect.isclass(o)]
    assert len(objects) > 20
    for obj in objects:
        what = "class" if inspect.isclass(obj) else "function"
        lines = inspect.getdoc(obj).splitlines()
        for hook in hooks:
            seen = list(lines)
            hook(None, what, f"optax_gwt.{obj.__name__}", obj, {}, seen)
            assert seen == lines, f"{hook.__name__} rewrites the docstring of {obj.__name__}"
