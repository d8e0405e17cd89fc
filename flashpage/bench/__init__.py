"""Benchmarks behind `flashpage bench ...`."""
