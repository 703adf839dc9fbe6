"""The ``TOPS_*`` environment variables, read in one place so that a typo is an error, not a no-op."""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def flag(name: str) -> bool:
    """A boolean variable; any value other than 1/true/yes/on, 0/false/no/off (or unset) is a ValueError."""
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a boolean: use one of {', '.join(_TRUE + _FALSE[1:])}")


def names(name: str) -> list[str]:
    """A comma-separated list of names, blanks dropped."""
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]
