"""Builds autopar._native (native/src, C++17, pybind11); everything else is in pyproject.toml."""
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

native = Pybind11Extension(
    "autopar._native",
    sorted(glob("native/src/*.cc") + glob("native/src/algorithms/*.cc")),
    cxx_std=17,
    extra_compile_args=["-O3"],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
