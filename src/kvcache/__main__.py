"""``python -m kvcache``: the same as the ``kvcache`` command."""

import sys

from .apps.cli import main

sys.exit(main())
