"""`python -m servescope.cli`: the same as the `servescope` command."""

import sys

from servescope.cli import main

# guarded: parallel workers are spawned processes, which import the main module again
if __name__ == "__main__":
    sys.exit(main())
