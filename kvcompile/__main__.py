"""`python -m kvcompile demo` runs the same command line as the `kvcompile` console script."""

import sys

from kvcompile.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
