"""`python -m kcaas ...`: the command line of kcaas.cli (the same as the `kcaas` console script)."""

import sys

from kcaas.cli import main

sys.exit(main())
