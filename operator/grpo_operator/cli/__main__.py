"""`python -m grpo_operator.cli`: the `grporun` command without its console script."""

import sys

from . import main

sys.exit(main())
