"""Benchmarks (bench/README.md): each prints ratios from one process run and asserts nothing;
the services never import them."""
