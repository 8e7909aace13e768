"""Pure numerics: no I/O, no CLI. The dtype table, unit roundoff, noise floors, metrics,
summary statistics and their numba kernels. Everything above imports from here; nothing here
imports from the rest of driftcheck (errors aside)."""
