"""`python -m loadgen ...` is `dsv4 loadtest ...`."""

import sys

from loadgen.cli import main

sys.exit(main())
