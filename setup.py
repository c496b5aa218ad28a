"""Build configuration that pyproject.toml cannot express: the optional compiled cores.

`mixer._tarwalk` (C, CPython API only) is the common case of the tar walk and the token decode; it
is `optional`, so an install without a C compiler still succeeds and mixer uses its pure-Python
reader (the one the compiled core defers to for everything unusual, and the oracle of its tests).
`mixer._rows` (C, optional the same way) copies the padded collate's rows and the packed one's
segments into place; without it `mixer.batching.collate` copies them with numpy, its oracle. `mixer._loops`
(the same) runs the deficit selector's per-pick loops; without it `mixer.mixing.selector` uses numpy.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BANNER = """
******************************************************************************
wds-mixer: the compiled cores {missing} were NOT built (no working C compiler?).
The package installs and works in pure Python, several times slower on the
read, collate and selection paths. `mixer info` says which cores are active.
For full speed install a C compiler (gcc or clang) and the Python headers,
then reinstall.
******************************************************************************
"""


class LoudBuildExt(build_ext):
    """`optional=True` lets the build go on without a compiler, but setuptools only logs one line
    among hundreds; say it where it is seen, once, after the build."""

    def run(self) -> None:
        super().run()
        missing = [ext.name for ext in self.extensions if not os.path.exists(self.get_ext_fullpath(ext.name))]
        if missing:
            sys.stderr.write(BANNER.format(missing=", ".join(missing)))


setup(
    cmdclass={"build_ext": LoudBuildExt},
    ext_modules=[
        Extension("mixer._native._tarwalk", ["mixer/_native/_tarwalk.c"], optional=True),
        Extension("mixer._native._rows", ["mixer/_native/_rows.c"], optional=True),
        Extension("mixer._native._loops", ["mixer/_native/_loops.c"], optional=True),
    ],
)
