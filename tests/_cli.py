"""Running the ``fsdp-overlap`` command in-process, as the CLI tests do."""

from __future__ import annotations

import json

from fsdp_overlap_plugin.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)
