"""Build of the optional C module ``abscore._native`` (the rest is in setup.cfg).

``optional=True``: where it cannot be compiled (no C compiler, no Python headers) the
installation goes on without it, and the project runs the numpy twins of its loops
(``abscore.native``)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("abscore._native", ["abscore/_native.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c99"])])
