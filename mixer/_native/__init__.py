"""The optional compiled cores, and the one switch for all of them.

Three C extensions (CPython API only) speed up the hot paths; each has a pure-Python oracle that is
also its fallback, so mixer works, only slower, without them:

- ``_tarwalk``: the common case of the tar walk and the token decode (:mod:`mixer.read.tario`,
  :mod:`mixer.read.decode`);
- ``_rows``: the padded collate's row copies and the packed one's segments (:mod:`mixer.batching.collate`);
- ``_loops``: the deficit selector's per-pick loops, the shuffle buffer's draws and the bucketer's
  core (:mod:`mixer.mixing.selector`, :mod:`mixer.plan.world`, :mod:`mixer.batching.batchers`).

They are built when the package is installed where a C compiler exists (``setup.py`` marks them
optional). ``MIXER_NATIVE=0`` in the environment, read once when mixer is imported, turns all of
them off: the way to run the pure-Python path on purpose (the tests use it to check the fallback).
:func:`cores` says which are active; ``mixer info`` prints it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

#: False when ``MIXER_NATIVE=0`` was set as mixer was imported: no compiled core is loaded then.
ENABLED: bool = os.environ.get("MIXER_NATIVE", "1").strip() != "0"
NAMES = ("_tarwalk", "_rows", "_loops")


def _load(name: str) -> ModuleType | None:
    if not ENABLED:
        return None
    try:
        return importlib.import_module(f"mixer._native.{name}")
    except ImportError:  # built without a C compiler: the pure-Python path runs
        return None


# Any: the extensions ship no type stubs; each user checks for None before it calls one.
tarwalk: Any = _load("_tarwalk")
rows: Any = _load("_rows")
loops: Any = _load("_loops")


def cores() -> dict[str, bool]:
    """Which compiled cores this process uses, by name."""
    return {"tarwalk": tarwalk is not None, "rows": rows is not None, "loops": loops is not None}
