"""``python -m fsdp_overlap_plugin.accelerate SCRIPT [ARGS]``: run a training script with the
Accelerate adapter imported first, so a script that never imports the plugin (a transformers
``Trainer`` script, one of Accelerate's examples) trains through it:

    accelerate launch --config_file configs/overlap.yaml --num_processes 2 \\
        -m fsdp_overlap_plugin.accelerate train.py --its-own args

(``accelerate launch -m`` runs a module in each worker; this one imports
``fsdp_overlap_plugin.accelerate``, which adopts every ``Accelerator`` of the FSDP launch, then
runs SCRIPT as ``__main__`` with SCRIPT and its arguments as ``sys.argv``. ``-m MODULE`` in
place of SCRIPT runs a module.) ``fsdp-overlap launch`` starts scripts this way.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import fsdp_overlap_plugin.accelerate  # noqa: F401  (adopts the FSDP launch's Accelerators)

USAGE = "usage: python -m fsdp_overlap_plugin.accelerate SCRIPT [ARGS] | -m MODULE [ARGS]"


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        raise SystemExit(0 if argv else 2)
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            raise SystemExit(2)
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = str(Path(argv[0]).resolve().parent)  # what `python SCRIPT` puts first (`-m` put the cwd)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
