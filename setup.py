"""Build the optional fused reduction kernel; everything else is in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("actrace.reduce._kernel", ["actrace/reduce/_kernel.c"], extra_compile_args=["-O3", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"],
                             optional=True)])
