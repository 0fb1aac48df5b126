"""The documentation holds: its code runs, its API reference is complete, its links and headline hold.

- the runnable blocks of every docs/**/*.md page run as pasted (tests/markdown_blocks.py);
- the docstring examples (``>>>``) of every module of optax_gwt run as doctests;
- every name of ``optax_gwt.__all__`` and every public submodule has an entry in docs/api/;
- the README's relative links and images exist, and so do the docs pages' links to files;
- the README's headline table is the default study's report;
- no file of the repository names a folder of the machine that wrote it (a path under /work, /root, /home).

The site itself is built by ``python -m sphinx -W -b html docs docs/_build/html`` (CI).
"""

from __future__ import annotations

import doctest
import glob
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import shlex
import subprocess

import pytest

import optax_gwt
from markdown_blocks import DOCS, MARKER, README, REPO, block_id, blocks_of, doc_pages, marker_lines, read, run_block
from optax_gwt import _extras

PAGES = doc_pages()
BLOCKS = blocks_of(PAGES)
API_PAGES = [p for p in PAGES if os.path.dirname(p) == os.path.join(DOCS, "api")]

# ---------------------------------------------------------------------------
# The docs pages' code blocks.
# ---------------------------------------------------------------------------


def test_pages_exist_and_have_runnable_blocks():
    assert PAGES and BLOCKS, "no docs pages or no runnable block in docs/"


@pytest.mark.parametrize("path", PAGES, ids=[os.path.relpath(p, REPO) for p in PAGES])
def test_every_marker_is_on_a_python_block(path):
    text = read(path)
    assert marker_lines(text) == len(blocks_of([path])), f"a {MARKER} line not directly above a ```python fence"


@pytest.mark.parametrize("path, line, code", BLOCKS, ids=[block_id(p, line) for p, line, _ in BLOCKS])
def test_runnable_block_runs(path, line, code):
    run_block(path, line, code)


# ---------------------------------------------------------------------------
# Doctests: the docstring examples of every module.
# ---------------------------------------------------------------------------

MODULES = sorted(
    [m.name for m in pkgutil.walk_packages(optax_gwt.__path__, "optax_gwt.")] + ["optax_gwt"],
)
FLAX = importlib.util.find_spec("flax") is not None


def _import(name: str):
    """The module, or a skip where its extra is not installed (the message names the extra)."""
    module = _import_if_installed(name)
    if module is None:
        pytest.skip(f"{name}: its extra is not installed")
    return module


def _import_if_installed(name: str):
    try:
        return importlib.import_module(name)
    except _extras.MissingExtraError:
        return None
    except ImportError:
        if not FLAX:  # a module of the plan extra, without Flax
            return None
        raise


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = _import(name)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    failures = []
    for test in finder.find(module, name):  # each docstring with a copy of the module's globals
        if test.filename and os.path.abspath(test.filename) != os.path.abspath(module.__file__):
            continue  # a docstring of another module, imported into this one
        runner.run(test, out=failures.append)
    assert not failures, "".join(failures)


# ---------------------------------------------------------------------------
# The API reference.
# ---------------------------------------------------------------------------

_DIRECTIVE = re.compile(
    r"^\s*\.\. (auto(?:function|class|data|module|exception))::\s+(\S+)[ \t]*\n((?:[ \t]+:[^\n]*\n)*)", re.M
)
_CURRENT = re.compile(r"^\s*\.\. currentmodule::\s+(\S+)", re.M)


def documented() -> set[str]:
    """Full names with an autodoc entry on the API pages; ``automodule`` with ``:members:`` counts its members."""
    names: set[str] = set()
    for page in API_PAGES:
        text = read(page)
        module = (_CURRENT.findall(text) or [""])[0]
        for kind, name, options in _DIRECTIVE.findall(text):
            name = name if name.startswith("optax_gwt") or not module else f"{module}.{name}"
            names.add(name)
            members = re.search(r":members:(.*)", options)
            if kind == "automodule" and members:
                listed = [m.strip() for m in members.group(1).split(",") if m.strip()]
                names |= {f"{name}.{m}" for m in listed or getattr(importlib.import_module(name), "__all__", [])}
    return names


def public_submodules() -> list[str]:
    return [m for m in MODULES if m != "optax_gwt" and not any(p.startswith("_") for p in m.split("."))]


def test_every_public_name_is_in_the_api_reference():
    entries = documented()
    missing = [n for n in optax_gwt.__all__ if f"optax_gwt.{n}" not in entries]
    assert not missing, f"names of optax_gwt.__all__ with no entry in docs/api/*.md: {missing}"


def test_every_public_submodule_and_its_names_are_in_the_api_reference():
    """Each public submodule has an automodule entry; each name of its __all__ an entry there or at the top."""
    entries = documented()
    missing = [m for m in public_submodules() if m not in entries]
    assert not missing, f"public submodules with no automodule entry in docs/api/*.md: {missing}"
    for name in public_submodules():
        module = _import_if_installed(name)  # a module of an extra not installed here is checked where it is
        for member in getattr(module, "__all__", []):
            top = member in optax_gwt.__all__ and getattr(optax_gwt, member) is getattr(module, member)
            same = [m for m in entries if m.rsplit(".", 1)[-1] == member and m.rsplit(".", 1)[0] in public_submodules()]
            same = [
                m
                for m in same
                if getattr(_import_if_installed(m.rsplit(".", 1)[0]), member, None) is getattr(module, member)
            ]
            if not (f"{name}.{member}" in entries or top or same):
                missing.append(f"{name}.{member}")
    assert not missing, f"names of public submodules' __all__ with no entry in docs/api/*.md: {missing}"


# ---------------------------------------------------------------------------
# Links.
# ---------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _links(path: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", read(path), flags=re.S | re.M)  # not inside code blocks
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # relative ones


@pytest.mark.parametrize("path", [README, *PAGES], ids=[os.path.relpath(p, REPO) for p in [README, *PAGES]])
def test_relative_links_exist(path):
    bad = []
    for target in _links(path):
        file, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(where):
            bad.append(target)
        elif anchor and where.endswith(".md"):
            headings = re.findall(r"^#+\s+(.*)$", read(where), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                bad.append(target)
    assert not bad, f"links of {os.path.relpath(path, REPO)} to nothing: {bad}"


def test_readme_links_into_every_docs_section():
    linked = {os.path.normpath(os.path.join(REPO, t.partition("#")[0])) for t in _links(README)}
    skip = ("index.md", "changelog.md")  # the README links CHANGELOG.md itself
    top = [p for p in PAGES if os.path.dirname(p) == DOCS and not p.endswith(skip)]
    missing = [os.path.relpath(p, REPO) for p in top if p not in linked]
    assert not missing, f"docs pages the README does not link to: {missing}"


# ---------------------------------------------------------------------------
# The README's headline table is the default study's.
# ---------------------------------------------------------------------------

#: The studies the README's headline table quotes: the default study, and the eighth-state study
#: run on the same task (an optimizer's row is taken from the first report that has it).
STUDY_REPORTS = [os.path.join(REPO, "results", "study", f"{n}-report", "report.md") for n in ("default", "eighth")]


def _rows(text: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("|")
    ]


def test_headline_table_is_the_default_study():
    text = read(README)
    table = text.split("<!-- headline-table:start -->", 1)[1].split("<!-- headline-table:end -->", 1)[0]
    header, _, *rows = _rows(table)
    report = {row[0]: row for path in reversed(STUDY_REPORTS) for row in _rows(read(path))}
    column = {name: header.index(name) for name in header}
    assert len(rows) >= 4
    for row in rows:
        name = row[column["`--optimizer`"]].strip("`")
        # The report's columns: optimizer, lr, alpha, other, val loss, tried, state MiB, matrix MiB, ratio, ...
        ref = report[name]
        loss = row[column["val loss (3 seeds)"]].strip("*")
        assert ref[4].startswith(loss) and ref[4].endswith("(3)"), (name, loss, ref[4])
        assert row[column["state MiB"]] == ref[6] and row[column["matrices' state MiB"]] == ref[7], (name, ref)
        assert row[column["matrices' state / AdamW's"]] == ref[8], (name, ref)
        lr, *alpha = [s.strip() for s in row[column["lr, alpha"]].split(",")]
        assert lr == ref[1] and (not alpha or alpha[0] == ref[2]), (name, ref)


_LOSS_FIGURE = re.compile(r"(?<![\w.])\d\.\d{4}(?!\d)")


def _committed_figures() -> set[str]:
    """Every four-decimal figure of the committed results: as written in their tables, and their
    longer floats (JSON, JSONL) rounded to four decimals."""
    figures: set[str] = set()
    for path in glob.glob(os.path.join(REPO, "results", "**", "*"), recursive=True):
        if not path.endswith((".md", ".json", ".jsonl")):
            continue
        text = read(path)
        figures |= set(_LOSS_FIGURE.findall(text))
        figures |= {f"{float(x):.4f}" for x in re.findall(r"(?<![\w.])\d\.\d{5,}", text)}
    return figures


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (sample output, not a claim)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def test_every_loss_figure_is_a_committed_result():
    """One story per claim: a four-decimal figure (a loss, a ratio) that a page states is one that a
    committed results file holds, so that a rerun study cannot leave an old figure on any page."""
    figures = _committed_figures()
    stale = {
        os.path.relpath(page, REPO): sorted(set(_LOSS_FIGURE.findall(_prose(read(page)))) - figures)
        for page in [README, *PAGES]
    }
    assert not {page: missing for page, missing in stale.items() if missing}


# ---------------------------------------------------------------------------
# The generated blocks of the study and performance pages are their results files'.
# ---------------------------------------------------------------------------

STUDY_PAGE = os.path.join(DOCS, "study_records.md")
PERFORMANCE_PAGE = os.path.join(DOCS, "performance_records.md")


def _between(text: str, start: str, end: str) -> str:
    assert start in text and end in text, (start, end)
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def test_study_blocks_are_the_committed_reports(monkeypatch):
    """Each study-report block is what ``sweep --report --readme docs/study_records.md`` writes from the
    committed report."""
    sweep = pytest.importorskip("examples.llama.sweep")
    monkeypatch.chdir(REPO)
    text = read(STUDY_PAGE)
    keys = re.findall(r"^<!-- study-report (\S+):start -->$", text, flags=re.M)
    assert len(keys) >= 6, keys
    for key in keys:
        block = _between(text, *sweep.readme_markers(key))
        command = re.match(r"Written by `([^`]+)`", block).group(1)
        assert "--readme docs/study_records.md" in command, command
        expected = sweep.readme_block(read(os.path.join(key, "report.md")), key, "docs/study_records.md", command)
        assert block == expected.strip("\n"), f"the {key} block of docs/study_records.md is not its report.md"


def test_comparison_blocks_are_the_saved_results(monkeypatch):
    """The 100- and 400-step comparison tables are those of results/llama and results/llama-long."""
    compare = pytest.importorskip("examples.llama.compare")
    monkeypatch.chdir(REPO)
    text = read(STUDY_PAGE)
    for directory in ("results/llama", "results/llama-long"):
        block = _between(text, *compare.markers(directory))
        report = compare.load_report(directory)
        assert compare.table(report["runs"]) in block and compare.provenance(report) in block, directory
        assert f"](../{directory}/val_loss.png)" in block, directory


def test_performance_block_is_its_json(monkeypatch):
    """The performance tables' timings, state sizes and verdicts are those of the JSON named in the block.

    (Compared cell by cell rather than as text, so that a new column of the renderer does not
    need a re-render of an old JSON: ``benchmarks.optimizer_step --render JSON --readme docs/performance_records.md``.)
    """
    monkeypatch.chdir(REPO)
    text = read(PERFORMANCE_PAGE)
    start = "<!-- performance-table:start (written by python -m benchmarks.optimizer_step --readme) -->"
    block = _between(text, start, "<!-- performance-table:end -->")
    out = re.search(r"^Command: `[^`]*--out ([^\s`]+)", block, flags=re.M).group(1)
    with open(out + ".json") as fh:
        report = json.load(fh)
    sections = dict(re.findall(r"^### (\S+) \([^)]*\)\n\n((?:\|.*\n)+)", block + "\n", flags=re.M))
    assert set(report["models"]) <= set(sections), (list(report["models"]), list(sections))
    for model, res in report["models"].items():
        rows = {row[0]: row for row in _rows(sections[model])[2:]}
        for name, r in res["optimizers"].items():
            expected = [
                f"{r['step_median_s'] * 1e3:.1f}",
                f"{r['step_ratio']:.2f}",
                f"{r['update_median_s'] * 1e3:.1f}",
                f"{r['update_ratio']:.2f}",
                f"{r['state_bytes'] / 2**20:.1f}",
            ]
            assert rows[name][1:6] == expected, (model, name, rows[name], expected)
    for line in report["verdict"]:
        assert f"- {line}" in block, line


def test_figure_script_runs(tmp_path):
    """docs/figures/make_figures.py still draws the algorithm page's figure (into a temporary folder here)."""
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("make_figures", os.path.join(DOCS, "figures", "make_figures.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.OUT = str(tmp_path / "gwt_stages.png")
    script.main()
    with open(script.OUT, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.exists(os.path.join(DOCS, "figures", "gwt_stages.png"))


_PATH = re.compile(r"(?<![\w/.-])((?:examples|benchmarks|results|optax_gwt|tests|docs)/[\w./-]*\w)")
_MODULE = re.compile(r"python -m ((?:examples|benchmarks|optax_gwt)[\w.]*)")


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` names a module of this checkout or of the environment
    (one of an extra not installed here counts by its file)."""
    try:
        return importlib.util.find_spec(name) is not None
    except _extras.MissingExtraError:
        where = os.path.join(REPO, *name.split("."))
        return os.path.exists(where + ".py") or os.path.exists(os.path.join(where, "__init__.py"))


def _git_ignores(name: str) -> bool:
    """Whether git ignores `name` in this checkout (a build output); False outside a git checkout."""
    try:
        done = subprocess.run(["git", "check-ignore", "-q", name], cwd=REPO, capture_output=True, check=False)
    except OSError:
        return False
    return done.returncode == 0


@pytest.mark.parametrize("path", [README, *PAGES], ids=[os.path.relpath(p, REPO) for p in [README, *PAGES]])
def test_named_files_and_modules_exist(path):
    """The files (``examples/llama/train.py``, ``results/plan/1b-...``) and ``python -m`` modules a page names exist.

    An output prefix (``--out results/plan/1b-1dev-h100``) counts when files start with it; the
    ``Command:`` lines of saved results are history, and not checked; nor are build outputs
    (``docs/_build/html``), which git ignores and a fresh clone does not have.
    """
    text = "\n".join(line for line in read(path).splitlines() if not line.startswith("Command: "))
    missing = []
    for name in sorted(set(_PATH.findall(text))):
        where = os.path.join(REPO, name)
        if not (os.path.exists(where) or glob.glob(glob.escape(where) + "*") or _git_ignores(name)):
            missing.append(name)
    missing += [f"-m {m}" for m in sorted(set(_MODULE.findall(text))) if not _module_exists(m)]
    assert not missing, f"{os.path.relpath(path, REPO)} names what does not exist: {missing}"


# (page, the block's opening marker, the results file it must equal), as the command in the marker wrote it.
PERF = "performance_records.md"
RESULT_BLOCKS = [
    ("guides/levanter.md", "levanter-run", "python -m benchmarks.levanter_run --steps 60 --out results/levanter/run",
     "results/levanter/run.md"),
    ("guides/numerics.md", "constant-gradient", "python -m benchmarks.constant_gradient --out "
     "results/numerics/constant_gradient", "results/numerics/constant_gradient.md"),
    ("guides/levanter.md", "maxtext-run", "python -m benchmarks.maxtext_run --steps 40 --out results/maxtext/run",
     "results/maxtext/run.md"),
    ("guides/levanter.md", "maxtext-text", "python -m benchmarks.maxtext_text --out results/maxtext/text",
     "results/maxtext/text.md"),
    (PERF, "targets-table", "python -m benchmarks.target_compile --out results/targets/update",
     "results/targets/update.md"),
    (PERF, "targets-1b", "python -m benchmarks.target_compile --model 1b --layers 1 --optimizers gwt1 gwt2 "
     "gwt3 --out results/targets/update-1b-layer", "results/targets/update-1b-layer.md"),
    (PERF, "targets-7b", "python -m benchmarks.target_compile --model 7b --layers 1 --optimizers gwt1 gwt2 "
     "gwt3 --out results/targets/update-7b-layer", "results/targets/update-7b-layer.md"),
    (PERF, "targets-train", "python -m benchmarks.target_compile --optimizers gwt1 gwt2 gwt3 --step train "
     "--out results/targets/train", "results/targets/train.md"),
    (PERF, "targets-train-7b", "python -m benchmarks.target_compile --model 7b --layers 1 --optimizers "
     "gwt1 gwt2 gwt3 --step train --out results/targets/train-7b-layer", "results/targets/train-7b-layer.md"),
    (PERF, "targets-train-7b-xla", "python -m benchmarks.target_compile --model 7b "
     "--layers 1 --optimizers gwt1 gwt2 gwt3 --step train --targets v5e v6e --fast-path no-pallas "
     "--out results/targets/train-7b-layer-xla",
     "results/targets/train-7b-layer-xla.md"),
    (PERF, "targets-fsdp", "python -m benchmarks.target_compile --model 7b --fsdp 64 --optimizers gwt2 "
     "gwt2-delayed gwt2-nolimit adamw-stacked gwt2-stacked gwt2-stacked-delayed --out results/targets/update-7b-fsdp64",
     "results/targets/update-7b-fsdp64.md"),
    (PERF, "targets-train-fsdp", "python -m benchmarks.target_compile --model 7b --fsdp 64 --step train "
     "--optimizers adamw-stacked gwt2-stacked --out results/targets/train-7b-fsdp64",
     "results/targets/train-7b-fsdp64.md"),
    ("guides/planning.md", "plan-target", "results/plan/targets/h100-7b.md", "results/plan/targets/h100-7b.md"),
    ("guides/planning.md", "plan-target-v5e", "results/plan/targets/v5e-1b.md", "results/plan/targets/v5e-1b.md"),
    ("guides/planning.md", "plan-target-v5e-64", "results/plan/targets/v5e-7b-fsdp64.md",
     "results/plan/targets/v5e-7b-fsdp64.md"),
]  # fmt: skip


@pytest.mark.parametrize("page,name,source,results", RESULT_BLOCKS, ids=[b[1] for b in RESULT_BLOCKS])
def test_results_block_is_its_results_file(page, name, source, results):
    """A table the docs quote from a results file is that file, as its command wrote it."""
    block = _between(read(os.path.join(DOCS, page)), f"<!-- {name}:start ({source}) -->", f"<!-- {name}:end -->")
    assert block == read(os.path.join(REPO, results)).strip("\n")


# ---------------------------------------------------------------------------
# No machine paths: what the repository holds names its files relative to its root.
# ---------------------------------------------------------------------------

#: An absolute path under /work, /root or /home, a folder of one machine; not one inside a URL or a relative
#: path (after a word character or a dot: ``https://host/home/``, ``src/work/``, ``../home/``).
_MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|home)/")


def _tracked_text_files() -> list[str]:
    """The files git tracks here that are text (UTF-8, no NUL byte), relative to the root; skips outside a checkout."""
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    texts = []
    for name in done.stdout.decode().split("\0"):
        path = os.path.join(REPO, name)
        if not name or not os.path.isfile(path):  # a file git tracks but this work tree has not (yet)
            continue
        with open(path, "rb") as fh:
            data = fh.read()
        try:
            if b"\0" not in data:
                data.decode("utf-8")
                texts.append(name)
        except UnicodeDecodeError:
            pass  # an image or another binary file
    return texts


def machine_paths(text: str) -> list[str]:
    """Where `text` names an absolute path of a machine: ``"<line number>: <the path, with some text before>"``."""
    found = []
    for i, line in enumerate(text.splitlines(), 1):
        found += [f"{i}: ...{line[max(0, m.start() - 20) : m.start() + 60]}" for m in _MACHINE_PATH.finditer(line)]
    return found


def test_machine_path_pattern():
    root = "/"  # apart from the names, or this file would name what it checks for
    found = machine_paths(f'a\n--out {root}work/main/results/x\nb\n"{root}root/.cache/x"\n({root}home/me/y)')
    assert [line.split(":")[0] for line in found] == ["2", "4", "5"], found
    assert not machine_paths("--out results/x\nhttps://host/home/x ./work/x src/work/x ../home/x /tmp/x /workx/")


def test_no_tracked_file_names_a_machine_path():
    """Results, docs and recorded commands name paths relative to the repository's root, as its tools do."""
    files = _tracked_text_files()
    assert len(files) > 100, "git ls-files listed too few text files"
    bad = {name: found for name in files if (found := machine_paths(read(os.path.join(REPO, name))))}
    assert not bad, f"absolute paths of a machine in tracked files (make them relative to the root): {bad}"


def test_recorded_commands_name_paths_relative_to_the_root():
    """The tools that record their command (and the comparison its runs' arguments) write no machine path."""
    rundir = pytest.importorskip("examples.llama.rundir")
    from benchmarks import optimizer_step

    inside, outside = os.path.join(REPO, "results", "x"), os.path.join(os.path.dirname(REPO), "elsewhere", "x")
    argv = ["--out", inside, f"--run-dir={inside}", "--steps", "3", outside]
    want = ["--out", "results/x", "--run-dir=results/x", "--steps", "3", outside]
    assert shlex.split(rundir.command_line("examples.llama.train", argv))[3:] == want
    benchmark = optimizer_step.command_line("benchmarks.optimizer_step", argv)
    assert benchmark == " ".join(["python", "-m", "benchmarks.optimizer_step", *want])
    assert [rundir.repo_relative(a) for a in argv] == want


# ---------------------------------------------------------------------------
# The front door: what a newcomer reads first fits the page, and says one thing once.
# ---------------------------------------------------------------------------

#: The pages a newcomer lands on: their code fits a code box at page width.
FRONT = [README, *(os.path.join(DOCS, p) for p in ("index.md", "getting_started.md", "study.md", "performance.md"))]
#: The result pages and guides: short enough to read (their records are pages of their own).
SHORT = [
    os.path.join(DOCS, p)
    for p in ("index.md", "getting_started.md", "study.md", "performance.md", *(f"guides/{g}" for g in os.listdir(
        os.path.join(DOCS, "guides")) if g.endswith(".md")))
]  # fmt: skip


@pytest.mark.parametrize("path", FRONT, ids=[os.path.relpath(p, REPO) for p in FRONT])
def test_front_pages_code_fits_its_box(path):
    """No line of a code block on the front pages is longer than 88 characters (the code box's
    width at the theme's text width; wider lines scroll)."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", read(path), flags=re.S)
    long = [line for block in blocks for line in block.splitlines() if len(line) > 88]
    assert not long, long


@pytest.mark.parametrize("path", SHORT, ids=[os.path.relpath(p, REPO) for p in SHORT])
def test_guides_and_result_pages_are_short(path):
    """At most about 15,000 characters: a page's records go on a page of their own."""
    assert len(read(path)) <= 15_500, len(read(path))


def test_readme_front_page_order():
    """The README opens with what GWT and FOAM are, then install and run (the tests and the
    main job), then the quickstart (within the first 60 lines, with FOAM), which optimizer and
    what fits where; no paragraph holds more than six figures."""
    text = read(README)
    lines = text.splitlines()
    quickstart = next(i for i, line in enumerate(lines) if line == "## Quickstart")
    assert quickstart < 60 and "foam_adamw" in "\n".join(lines[quickstart : quickstart + 30])
    heads = [line for line in lines if line.startswith("## ")]
    assert heads[:4] == ["## Install and run", "## Quickstart", "## Which optimizer", "## What fits where"], heads
    assert "python -m examples.llama.train" in text.split("## Quickstart")[0]
    # figures, not code, links, paper ids or list numbers
    prose = re.sub(r"```.*?```|`[^`]*`|<!--.*?-->|\]\([^)]*\)|arXiv \d+\.\d+|^\d+\. ", "", text, flags=re.S | re.M)
    for paragraph in prose.split("\n\n"):
        if paragraph.lstrip().startswith(("|", "!", "#")):
            continue  # tables, images, headings
        figures = re.findall(r"(?<![\w.-])\d+(?:\.\d+)?(?:x|%)?(?![\w-])", paragraph)
        assert len(figures) <= 6, (figures, paragraph[:120])


def test_front_door_tables_are_their_results():
    """The README's "what fits where" table is ``results/plan/fits.md`` (which ``python -m
    optax_gwt.plan.fits --out results/plan/fits`` writes); the docs include the README's."""
    fits = read(os.path.join(REPO, "results", "plan", "fits.md")).strip("\n")
    block = _between(read(README), "<!-- fits:start -->", "<!-- fits:end -->")
    assert fits in block
    for page in ("index.md", "guides/planning.md"):
        assert "<!-- fits:start -->" in read(os.path.join(DOCS, page)), page


def test_the_site_scrolls_wide_tables():
    """The theme gets the stylesheet that puts wide tables in a scroll box and keeps short cells
    on one line."""
    css = read(os.path.join(DOCS, "_static", "tables.css"))
    assert "overflow-x: auto" in css and "nowrap" in css
    conf = read(os.path.join(DOCS, "conf.py"))
    assert '"tables.css"' in conf and '"tables.js"' in conf
