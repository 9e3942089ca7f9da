"""python -m ds_tsp.tools.bench [flags]: the bench command without the ds-tsp entry point."""
import sys

from ds_tsp.tools.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
