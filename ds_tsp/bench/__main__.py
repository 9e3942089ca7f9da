"""python -m ds_tsp.bench [flags]: the bench command without the ds-tsp entry point."""
import sys

from ds_tsp.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
