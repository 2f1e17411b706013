"""``python -m fsdp_overlap_plugin ...`` is the ``fsdp-overlap`` command."""

import sys

from .cli import main

sys.exit(main())
