"""`python -m modelcanary`: the same as the `modelcanary` command."""

import sys

from modelcanary.compose import main

sys.exit(main())
