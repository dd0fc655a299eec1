"""Benchmarks: `python -m bench.NAME [--quick]`; conventions in bench/_common.py."""
