"""`python -m servescope.cli`: the same as the `servescope` command."""

import sys

from servescope.cli import main

sys.exit(main())
