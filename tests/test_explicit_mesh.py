"""GWT on a mesh of explicit axes (jax.make_mesh's AxisType.Explicit), in a subprocess with 8 devices."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_explicit_mesh_equals_one_device():
    here = Path(__file__).resolve().parent
    path = os.pathsep.join(p for p in (str(here.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(here / "explicit_mesh_checks.py")], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "explicit mesh checks passed" in proc.stdout
