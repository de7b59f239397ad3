"""genqueue's benchmark: `python -m bench.run` (what `make bench` calls) writes docs/benchmarks.md."""
