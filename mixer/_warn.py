"""``warn``: :func:`warnings.warn` attributed to the user's line, not to a line of this library.

A fixed ``stacklevel`` cannot do that here: the same warning is reached from a constructor, from a
generator resumed by ``DataLoader`` (whose frames sit in between), or inside a forked DataLoader
worker (whose stack still holds the parent's frames down to the user's ``for batch in loader``). So
the level is counted: the first frame outside this package, torch's data loading and
multiprocessing. Where there is no such frame (a spawned worker), the warning shows no source line.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import warnings

import torch.utils.data

_INTERNAL = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (__file__, torch.utils.data.__file__, multiprocessing.__file__)
)


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn with the stack level of the nearest caller outside the library (see the module docstring)."""
    frame = sys._getframe(1)
    level = 2  # 1 would be this function's own frame
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level)
