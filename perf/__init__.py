"""The benchmarks, each run from the repository's root as `python -m perf.<name>`; every one
writes its results through perf/report.py. perf/README.md describes them."""
