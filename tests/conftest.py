import jax
import pytest


@pytest.fixture
def x64():
    """Runs a test with 64-bit floats (the reference comparisons are in float64)."""
    with jax.enable_x64(True):
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The quick subset (``-m "not slow"``) runs the first case of each parametrized
    test; the other cases count as slow, so every test function still runs once."""
    seen = set()
    for item in items:
        if not hasattr(item, "callspec"):
            continue
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        if key in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(key)
