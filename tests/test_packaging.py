"""The package as installed: one version, no import of the checkout's folders, one-line missing-extra errors."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys

import pytest

import optax_gwt
from optax_gwt import _extras

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "optax_gwt"


def test_version_is_the_metadata_version():
    assert optax_gwt.__version__ == importlib.metadata.version("optax-gwt")


def test_pyproject_reads_the_version_from_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "optax_gwt.__version__"}
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["optax_gwt", "optax_gwt.*"]
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["optax_gwt"]
    assert (PACKAGE / "py.typed").is_file()


def test_the_sdist_leaves_the_checkout_folders_out():
    lines = (ROOT / "MANIFEST.in").read_text().splitlines()
    assert {f"prune {d}" for d in ("tests", "examples", "benchmarks", "docs", "results")} <= set(lines)


def _imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_library_imports_nothing_from_the_checkout():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10
    bad = {
        str(f.relative_to(ROOT)): sorted(
            m for m in _imported_modules(f) if m.split(".")[0] in ("examples", "benchmarks", "tests")
        )
        for f in files
    }
    assert not {f: m for f, m in bad.items() if m}


def test_import_optax_gwt_needs_no_optional_package():
    code = (
        "import sys, optax_gwt, optax_gwt.modular, optax_gwt.models.llama_config, optax_gwt.plan.__main__\n"
        "print(sorted(m for m in ('flax', 'matplotlib', 'orbax', 'examples', 'benchmarks') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_missing_extra_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setattr(_extras, "_importable", lambda package: package != "flax")
    with pytest.raises(ImportError) as raised:
        with _extras.requires("plan", "optax_gwt.plan.llama"):
            raise ModuleNotFoundError("No module named 'flax'", name="flax")
    assert isinstance(raised.value, _extras.MissingExtraError)
    assert str(raised.value) == 'optax_gwt.plan.llama needs Flax: pip install "optax-gwt[plan]"'
    assert raised.value.__suppress_context__  # no chained traceback
    with pytest.raises(SystemExit) as exited:
        with _extras.exit_on_missing():
            _extras.check("plan", "optax_gwt.plan", "matplotlib", "flax")
    assert exited.value.code == 'optax_gwt.plan needs Flax: pip install "optax-gwt[plan]"'


def test_other_import_errors_pass_unchanged(monkeypatch):
    monkeypatch.setattr(_extras, "_importable", lambda package: package != "flax")
    with pytest.raises(ModuleNotFoundError) as raised:  # a dependency of Flax, not Flax: not translated
        with _extras.requires("plan", "optax_gwt.plan.llama"):
            raise ModuleNotFoundError("No module named 'msgpack'", name="msgpack")
    assert not isinstance(raised.value, _extras.MissingExtraError)
    with pytest.raises(ModuleNotFoundError):  # Flax installed, one of its submodules missing: a real error
        with _extras.requires("plan", "optax_gwt.plan.llama"):
            raise ModuleNotFoundError("No module named 'matplotlib.nope'", name="matplotlib.nope")


HIDE_FLAX = """
import runpy, sys
class HideFlax:  # as if Flax were not installed
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "flax":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, HideFlax())
sys.argv[0] = "optax_gwt.plan"
runpy.run_module("optax_gwt.plan", run_name="__main__", alter_sys=True)
"""


def test_planner_cli_without_flax_prints_one_line(tmp_path):
    """``python -m optax_gwt.plan`` where Flax is not installed: one line on stderr naming the extra, status 1."""
    args = [sys.executable, "-c", HIDE_FLAX, "--config", "60m", "--optimizers", "adamw", "gwt-2"]
    out = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 1, out
    assert out.stdout == "" and out.stderr == 'optax_gwt.plan needs Flax: pip install "optax-gwt[plan]"\n'


HIDE = """
import json, runpy, sys
class Hide:  # as if the package were not installed
    hidden = None
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == self.hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
hide = Hide()
sys.meta_path.insert(0, hide)
cases, catch = json.loads(sys.argv[1]), sys.argv[2] == "catch"
for module, args, hidden in cases:
    hide.hidden = hidden
    for name in list(sys.modules):  # each case as in a fresh process: not yet imported
        if name.partition(".")[0] in (hidden, "examples", "benchmarks"):
            del sys.modules[name]
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        print(json.dumps([module, hidden, "ran"]))
    except SystemExit as e:
        if not catch:
            raise
        print(json.dumps([module, hidden, e.code]))
"""

# (module, its arguments, the package hidden, the name its message gives it)
CLIS = [
    ("examples.llama.train", ["--steps", "1"], "flax", "Flax"),
    ("examples.llama.train", ["--steps", "1"], "tqdm", "tqdm"),
    ("examples.llama.sweep", ["--config", "examples/llama/studies/smoke.toml", "--report"], "matplotlib", "Matplotlib"),
    ("examples.llama.compare", ["--steps", "1"], "flax", "Flax"),
    ("benchmarks.plan_check", [], "flax", "Flax"),
    ("optax_gwt.levanter.train_lm", ["--config_path", "run.yaml"], "levanter", "Levanter"),
]


def _hidden_run(cases: list, catch: bool) -> subprocess.CompletedProcess:
    cases_json = json.dumps([[module, args, hidden] for module, args, hidden, *_ in cases])
    args = [sys.executable, "-c", HIDE, cases_json, "catch" if catch else "raise"]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_example_cli_without_its_extra_prints_one_line():
    """Each entry point of the example and the benchmarks, a package of its extra hidden, exits
    with one line naming the extra (in one interpreter, each case's modules imported afresh);
    the first case also in a process of its own: that line alone on stderr, status 1."""
    out = _hidden_run(CLIS, catch=True)
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(results) == len(CLIS), out
    for (module, _, hidden, name), (_, _, code) in zip(CLIS, results, strict=True):
        assert isinstance(code, str), (module, hidden, code)
        assert re.fullmatch(rf'\S+( \S+)* needs {name}: pip install "optax-gwt\[(examples|plan|levanter)\]"', code), (
            code
        )
    alone = _hidden_run(CLIS[:1], catch=False)
    assert alone.returncode == 1 and alone.stdout == "" and alone.stderr == results[0][2] + "\n", alone


def test_import_loads_no_kernel_and_no_private_jax():
    """The fast paths are imported when a step that may take them is traced, not with the package."""
    code = (
        "import sys, jax, optax\n"
        "before = set(sys.modules)\n"
        "import optax_gwt\n"
        "new = set(sys.modules) - before\n"
        "print(sorted(m for m in new if 'pallas' in m or m.startswith('jax._src') or m.count('optax_gwt.kernels.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "['optax_gwt.kernels.rules']"
    private = {str(f.relative_to(ROOT)) for f in PACKAGE.rglob("*.py") if "jax._src" in f.read_text()}
    assert not private


def test_the_wheel_ships_the_kernel_source():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["optax_gwt"]
    sources = sorted(str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.cc"))
    assert sources and all(any(pathlib.PurePath(s).match(p) for p in patterns) for s in sources), (sources, patterns)
