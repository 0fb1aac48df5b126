import jax
import pytest


@pytest.fixture
def x64():
    """Runs a test with 64-bit floats (the reference comparisons are in float64)."""
    with jax.enable_x64(True):
        yield
