"""Benchmarks that print tables, side by side with the alternatives in one run (`interp bench`).

They are not tests: timings are medians of repeats after warm-up, reported as ratios because the
machine is shared and noisy. `tests/test_benchmarks.py` only checks that each runs on a tiny size.
"""
