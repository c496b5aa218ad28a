"""``mixer info`` and ``mixer --version``: what this install is and which of its parts are active.

A wheel built where no C compiler was found still imports and streams (the pure-Python cores are
the compiled ones' oracles), only slower; this is where a user sees which case they have, without
reading build logs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
import sys

from mixer._native import ENABLED, cores
from mixer.storage.registry import SCHEMES

DISTRIBUTION = "wds-mixer"

#: The optional extras and the module whose presence says each is usable (the storage schemes' extras
#: come from their backends, see `extras`).
OTHER_EXTRAS = {
    "plot": "matplotlib",
    "audio": "soundfile",
    "text": "tokenizers",
    "zstd": "zstandard",
    "lightning": "lightning",
    "ray": "ray",
}


def extras() -> dict[str, tuple[str, ...]]:
    """Every optional extra and the modules it installs: the storage schemes' (their backends
    declare them) and the rest."""
    found: dict[str, tuple[str, ...]] = {}
    for backend in SCHEMES.backends():
        if backend.extra is not None:
            found[backend.extra] = tuple(dict.fromkeys(found.get(backend.extra, ()) + backend.needs))
    return found | {extra: (module,) for extra, module in OTHER_EXTRAS.items()}


def version() -> str:
    """The installed distribution's version (``0+unknown`` when run from a bare source tree)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def version_line() -> str:
    """One line for ``mixer --version``: the version and whether the compiled cores are in use."""
    active = [name for name, on in cores().items() if on]
    if len(active) == len(cores()):
        state = "compiled cores active"
    elif not ENABLED:
        state = "compiled cores off (MIXER_NATIVE=0)"
    else:
        state = f"compiled cores active: {', '.join(active) or 'none'} (the rest run in pure Python)"
    return f"{DISTRIBUTION} {version()} ({state})"


def report() -> list[str]:
    """The lines ``mixer info`` prints."""
    lines = [
        f"{DISTRIBUTION} {version()}",
        f"python {platform.python_version()} ({sys.executable})",
        f"platform {platform.platform()}",
    ]
    for module in ("numpy", "torch", "webdataset"):
        lines.append(f"{module} {_module_version(module)}")
    switch = "on" if ENABLED else "off (MIXER_NATIVE=0)"
    lines.append(f"compiled cores: {switch}")
    for name, on in cores().items():
        lines.append(f"  {name}: {'compiled' if on else 'pure Python'}")
    if ENABLED and not all(cores().values()):
        lines.append("  (built without a C compiler? reinstall where gcc/clang exists for full speed)")
    lines.append("optional extras:")
    for extra, modules in extras().items():
        found = all(importlib.util.find_spec(module) is not None for module in modules)
        lines.append(f"  {extra}: {'installed' if found else f'missing (pip install {DISTRIBUTION}[{extra}])'}")
    return lines


def _module_version(module: str) -> str:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _info(args: argparse.Namespace) -> int:
    print("\n".join(report()))
    return 0


def add_info_command(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction) -> None:
    """Register ``--version`` on the top-level parser and the ``info`` subcommand."""
    parser.add_argument("--version", action="version", version=version_line())
    info = sub.add_parser("info", help="print the version, the active compiled cores and the optional extras found")
    info.set_defaults(func=_info)
