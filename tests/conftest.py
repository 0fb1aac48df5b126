import jax

# The reference comparisons run in float64; tests that want float32 ask for it.
jax.config.update("jax_enable_x64", True)
