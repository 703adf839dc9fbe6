"""The ``TOPS_*`` environment variables, read in one place so that a typo is an error or a warning, not a no-op."""

from __future__ import annotations

import difflib
import os
import warnings

KNOWN = {
    "TOPS_FORCE": "force implementations per op, e.g. simple_gla=xla.chunk,kda=ref.recurrent",
    "TOPS_DENY": "never select these implementations (names or shell patterns, comma-separated)",
    "TOPS_STRICT": "no fallback past the forced or the highest-priority implementation",
    "TOPS_INTERPRET": "accept Pallas TPU kernels off TPU, run in Pallas' TPU interpreter",
    "TOPS_PLUGINS": "load only these plugins' entry points (comma-separated)",
    "TOPS_DISABLE_PLUGIN_AUTOLOAD": "load no entry points",
    "TOPS_STRICT_PLUGINS": "a plugin that fails to load is fatal at import",
}
"""Every variable tops reads, with what it does."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

_warned: set[str] = set()


def flag(name: str) -> bool:
    """A boolean variable; any value other than 1/true/yes/on, 0/false/no/off (or unset) is a ValueError."""
    value = _read(name).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a boolean: use one of {', '.join(_TRUE + _FALSE[1:])}")


def names(name: str) -> list[str]:
    """A comma-separated list of names, blanks dropped."""
    return [item.strip() for item in _read(name).split(",") if item.strip()]


def _read(name: str) -> str:
    if name not in KNOWN:
        raise KeyError(f"{name} is not a tops variable; add it to tops_core.environment.KNOWN")
    return os.environ.get(name, "")


def warn_unknown() -> None:
    """A ``RuntimeWarning`` for each ``TOPS_*`` variable that tops does not read (a typo of one it does),
    naming it and the known ones; once per name and process.

    Called when the plugins are loaded and whenever a call is decided afresh (not at every read
    or every call: scanning ``os.environ`` costs about a microsecond a variable).
    """
    for name in sorted(os.environ):
        if name.startswith("TOPS_") and name not in KNOWN and name not in _warned:
            _warned.add(name)
            close = difflib.get_close_matches(name, KNOWN, n=1)
            warnings.warn(
                f"tops: unknown environment variable {name} is ignored"
                + (f" (did you mean {close[0]}?)" if close else "")
                + f"; tops reads {', '.join(KNOWN)}",
                RuntimeWarning, stacklevel=2,
            )
