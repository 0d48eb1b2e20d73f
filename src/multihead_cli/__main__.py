"""``python -m multihead_cli ...``: the ``multihead`` command where its script is not on the PATH (a platform's
grading script names its interpreter)."""

import sys

from multihead_cli import main

sys.exit(main())
