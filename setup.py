"""Build configuration that pyproject.toml cannot express: the optional compiled cores.

`mixer._tarwalk` (C, CPython API only) is the common case of the tar walk and the token decode; it
is `optional`, so an install without a C compiler still succeeds and mixer uses its pure-Python
reader (the one the compiled core defers to for everything unusual, and the oracle of its tests).
`mixer._rows` (C, optional the same way) copies the padded collate's rows and the packed one's
segments into place; without it `mixer.batching.collate` copies them with numpy, its oracle. `mixer._loops`
(the same) runs the deficit selector's per-pick loops; without it `mixer.mixing.selector` uses numpy.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mixer._native._tarwalk", ["mixer/_native/_tarwalk.c"], optional=True),
        Extension("mixer._native._rows", ["mixer/_native/_rows.c"], optional=True),
        Extension("mixer._native._loops", ["mixer/_native/_loops.c"], optional=True),
    ]
)
