"""Unknown keys: the one "unknown key ... Did you mean ...? Valid keys: ..." message that
every config reader raises (the plugin's schema, the LightningCLI reader, the Accelerate
reader), and ``suggest``, the difflib lookup of the nearest valid choices.

Each reader words its message for where the key was found; the parts it varies are the
arguments of ``unknown_key_message``::

    {source}: {where}unknown {what}[ {shown}]{reason}.[ Did you mean ...?]{note}[ {tail}]
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..contract import OverlapConfigError

__all__ = ["check_keys", "suggest", "unknown_key_message"]

_AS_REPR = object()


def suggest(word: str, choices: list[str] | tuple[str, ...], n: int = 3) -> str:
    """A ' Did you mean ...?' suffix naming the nearest valid choices, or ''."""
    close = difflib.get_close_matches(str(word), list(choices), n=n, cutoff=0.5)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


def unknown_key_message(
    key: Any,
    valid: Sequence[str],
    *,
    source: str,
    shown: Any = _AS_REPR,
    what: str = "key",
    where: str = "",
    reason: str = "",
    lookup: str | None = None,
    note: str = "",
    tail: str = "",
) -> str:
    """The message for ``key``, which is not one of ``valid``: ``shown`` is the key as the
    message writes it (``repr(key)`` unless given; ``""`` writes none, when ``where``
    already names it), ``lookup`` the word matched against ``valid`` (``str(key)`` unless
    given), ``tail`` what follows the suggestion (the valid list), after a space."""
    shown_text = repr(key) if shown is _AS_REPR else str(shown)
    return (
        f"{source}: {where}unknown {what}{' ' + shown_text if shown_text else ''}{reason}."
        f"{suggest(str(key) if lookup is None else lookup, valid)}{note}{' ' + tail if tail else ''}"
    )


def check_keys(
    given: Iterable[Any],
    valid: Sequence[str],
    *,
    source: str,
    shown: Callable[[Any], str] = repr,
    tail: str | None = None,
    note: str = "",
    error: type[Exception] = OverlapConfigError,
) -> None:
    """Raise ``error`` (``unknown_key_message``) for the first of ``given`` not in ``valid``;
    ``shown`` writes the key, ``tail`` defaults to "Valid keys: <valid>."."""
    for key in given:
        if key not in valid:
            raise error(
                unknown_key_message(
                    key,
                    valid,
                    source=source,
                    shown=shown(key),
                    note=note,
                    tail=f"Valid keys: {', '.join(valid)}." if tail is None else tail,
                )
            )
