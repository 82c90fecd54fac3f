"""Benchmarks and comparison harnesses (they sit on top of the library and import downwards)."""
