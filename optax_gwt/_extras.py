"""Optional dependencies: the one-line message that names the extra to install.

The core library needs JAX, Optax, NumPy and PyWavelets only. A feature that
needs more (the Flax LLaMA model and the planner: Flax, and Matplotlib for the
planner's plot) imports it through `requires`, so that a missing package is an
`MissingExtraError` (an `ImportError`) whose message says what to install::

    optax_gwt.plan needs Flax: pip install "optax-gwt[plan]"

A command-line entry point checks first (`check`) and exits with that line
(`exit_on_missing`), without a traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

__all__ = ["PACKAGES", "MissingExtraError", "check", "entry_point", "exit_on_missing", "message", "requires"]

#: The optional packages' import names and the names the message gives them.
PACKAGES = {
    "flax": "Flax",
    "matplotlib": "Matplotlib",
    "orbax": "Orbax",
    "datasets": "Datasets",
    "tqdm": "tqdm",
    "levanter": "Levanter",
    "haliax": "Levanter",
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def message(feature: str, package: str, extra: str) -> str:
    """``'<feature> needs <Package>: pip install "optax-gwt[<extra>]"'``."""
    return f'{feature} needs {PACKAGES.get(package, package)}: pip install "optax-gwt[{extra}]"'


def _missing(feature: str, package: str, extra: str) -> MissingExtraError:
    return MissingExtraError(message(feature, package, extra), name=package)


@contextlib.contextmanager
def requires(extra: str, feature: str) -> Iterator[None]:
    """Imports inside the block that fail for a missing optional package raise `MissingExtraError`.

    Only a package of `PACKAGES` missing itself is translated; any other
    import error (a dependency of that package, a bug) passes unchanged.
    """
    try:
        yield
    except ModuleNotFoundError as e:
        package = (e.name or "").partition(".")[0]
        if package not in PACKAGES or _importable(package):
            raise
        raise _missing(feature, package, extra) from None


def _importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def check(extra: str, feature: str, *packages: str) -> None:
    """Raises `MissingExtraError` for the first of `packages` that is not installed (nothing is imported).

    Example:
      >>> from optax_gwt import _extras
      >>> try:
      ...     _extras.check("plan", "optax_gwt.plan", "no_such_package")
      ... except _extras.MissingExtraError as e:
      ...     print(e)
      optax_gwt.plan needs no_such_package: pip install "optax-gwt[plan]"
    """
    for package in packages:
        if not _importable(package):
            raise _missing(feature, package, extra)


@contextlib.contextmanager
def exit_on_missing() -> Iterator[None]:
    """For command-line entry points: a `MissingExtraError` in the block exits with its one line (status 1)."""
    try:
        yield
    except MissingExtraError as e:
        raise SystemExit(str(e)) from None


@contextlib.contextmanager
def entry_point(module: str, extra: str, feature: str) -> Iterator[None]:
    """The optional imports of a command-line module: `requires`, and one line on exit when run.

    Pass the module's ``__name__``: run as the program (``"__main__"``, as by
    ``python -m``), a missing optional package exits with the one line that
    names `extra` (status 1); imported, it raises `MissingExtraError`.

    """
    try:
        with requires(extra, feature):
            yield
    except MissingExtraError as e:
        if module == "__main__":
            raise SystemExit(str(e)) from None
        raise
