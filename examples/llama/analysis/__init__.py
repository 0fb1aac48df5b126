"""Analysis scripts of the studies' committed results: each reads and writes files under results/.

Run from the repository root as modules, e.g. ``python -m examples.llama.analysis.seqlen_ratios``.
"""

import os

#: The repository root: the results files' paths are relative to it, whatever the current directory.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
