"""`python -m clusterserve serve|fetch ...`: the `clusterserve` command."""

import sys

from clusterserve.cli import main

sys.exit(main())
