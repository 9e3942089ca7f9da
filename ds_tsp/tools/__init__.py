"""The `ds-tsp` command and what it runs: verify (and its single-device references), plan, bench, synthetic data."""
