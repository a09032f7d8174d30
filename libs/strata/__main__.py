"""`python -m strata` is the `strata` command."""

import sys

from strata.cli.main import main

sys.exit(main())
