import os
import shutil
import tempfile

# One XLA compilation cache per test run, shared by the pytest-xdist workers and the
# tests' subprocesses, which inherit the variables: a program compiled once in a run
# (an eager op, a train step that a test builds again) is read back, not compiled
# again. It starts empty, lives in a temporary folder and is removed at the end
# (a cache the user set up in JAX_COMPILATION_CACHE_DIR is used as it is).
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="optax-gwt-tests-xla-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

# LLVM's optimisations change how fast the generated code runs and, at float32 rounding,
# the order some sums are taken in; not XLA's fusions or buffers. The tests skip them (a
# tenth of the run; the planner does the same). The subprocesses inherit the flag; those
# that simulate devices append their count.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"

import jax  # noqa: E402  (reads the variables above when imported)
import pytest  # noqa: E402


@pytest.fixture
def x64():
    """Runs a test with 64-bit floats (the reference comparisons are in float64)."""
    with jax.enable_x64(True):
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The tests marked ``long`` go first: pytest-xdist then starts them on its workers while
    the short ones fill the time around them, instead of leaving one worker to finish them
    alone. The quick subset (``-m "not slow"``) runs the first case of each parametrized
    test; the other cases count as slow, so every test function still runs once."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: the rest keep their order
    seen = set()
    for item in items:
        if not hasattr(item, "callspec"):
            continue
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        if key in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(key)


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
