"""Benchmarks. Each writes one JSON file per run to bench/results/ (see record.py)."""
