"""The benchmarks: each module is a command that writes its results under ``results/``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_results(out: str, report: dict[str, Any], table: str) -> None:
    """Writes `report` to ``<out>.json`` and the Markdown `table` to ``<out>.md``, making the folder."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    Path(out + ".json").write_text(json.dumps(report, indent=1))
    Path(out + ".md").write_text(table + "\n")
