"""``python -m fsdp_overlap_plugin.cli``: the ``fsdp-overlap`` command."""

import sys

from .main import main

sys.exit(main())
