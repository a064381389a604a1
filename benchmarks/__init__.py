"""Benchmarks of pallas_gemm against jnp.dot: `python -m benchmarks --help`.

Modules: shapes (the problems), timing (CUPTI / wall clock), runner (the loop),
report (JSON, markdown, plots), __main__ (the command line).
"""
