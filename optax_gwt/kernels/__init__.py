"""The fast paths: chip-specific formulations of GWT's computations, in one place.

The math modules (`optax_gwt.haar`, `optax_gwt.adam`, `optax_gwt.stages`) state each
computation once, plainly. Where a chip's compiler does better with another formulation
of the same values, a row of `RULES` says so: which op, which platform, which programs
(one device or partitioned), under which condition, and what it saves. `select` reads
the table, and `switch` puts the rows into the program under
`jax.lax.platform_dependent`, so that the platform the program is compiled for picks.
The ``fast_path`` option of the builders and stages (`FastPath`) chooses what may be
taken: ``"auto"`` (the table), ``"xla"`` (the plain formulation everywhere), the opt-in
CPU kernel, or another platform's rows on any backend (to check them on a CPU).

Modules, imported when a row first needs them: `rules` (the table), `xla_chips` (XLA
formulations for TPUs and GPUs), `pallas_tpu` (a Pallas kernel for TPUs), `cpu_ffi` (a
compiled C++ kernel for CPUs), `lowering` (choices made when a program is lowered).
"""

from optax_gwt.kernels.rules import RULES, Case, FastPath, Rule, markdown_table, recording, select, switch

__all__ = ["RULES", "Case", "FastPath", "Rule", "markdown_table", "recording", "select", "switch"]
