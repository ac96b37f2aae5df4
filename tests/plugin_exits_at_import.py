"""An environment module that exits at import (a script with sys.exit at top level): validation must refuse it
naming environment.path, where it made `run` and `--dry-run` exit 0 having done nothing (a reviewer's find)."""

import sys

sys.exit(0)
