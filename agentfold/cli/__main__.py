"""`python -m agentfold.cli ...`: the same entry point as the `agentfold` script."""

import sys

from agentfold.cli import main

sys.exit(main())
