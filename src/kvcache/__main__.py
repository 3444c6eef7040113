"""``python -m kvcache``: the same as the ``kvcache`` command."""

import sys

from .cli import main

sys.exit(main())
