"""The one error type of the command line."""

from __future__ import annotations

__all__ = ["CliError"]


class CliError(Exception):
    """A user error: bad model spec, unreadable file, not a report. Exit code 2."""
