"""`python -m ds_tsp ...` (e.g. under `torchrun -m`): the `ds-tsp` command line."""
from ds_tsp.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
