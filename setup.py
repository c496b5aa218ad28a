"""Build configuration that pyproject.toml cannot express: the optional compiled reader core.

`mixer._tarwalk` (C, CPython API only) is the common case of the tar walk and the token decode; it
is `optional`, so an install without a C compiler still succeeds and mixer uses its pure-Python
reader (the one the compiled core defers to for everything unusual, and the oracle of its tests).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("mixer._tarwalk", ["mixer/_tarwalk.c"], optional=True),
        Extension("mixer._select", ["mixer/_select.c"], optional=True),
    ]
)
