"""Builds autopar._native (native/src, C++17, pybind11, with XLA FFI custom calls built against
jaxlib's headers); everything else is in pyproject.toml.

The C++ builds with -Wall -Wextra -Werror: a warning is a build failure, fixed in the source.
AUTOPAR_SANITIZE=1 in the environment builds it instead for the sanitizer tier (.ci/sanitize):
AddressSanitizer and UndefinedBehaviorSanitizer, -O1 with frame pointers and debug info. Such a
build needs the ASan runtime preloaded into Python (LD_PRELOAD=$(g++ -print-file-name=libasan.so))
and is for testing only; a normal install never sets it.
"""
import os
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

WARNINGS = ["-Wall", "-Wextra", "-Werror"]
# -fno-wrapv: Python's own flags include -fwrapv, which would hide signed overflow from UBSan
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g", "-fno-wrapv"]
sanitize = os.environ.get("AUTOPAR_SANITIZE", "") == "1"
# the sources compile one per core (AUTOPAR_BUILD_JOBS=N to choose): half the install's time here
ParallelCompile("AUTOPAR_BUILD_JOBS", default=0).install()



def xla_ffi_include() -> str:
    """The XLA FFI headers jaxlib ships (xla/ffi/api/*.h): the custom calls (xla_ffi.cc) are
    built against them; jaxlib is a build requirement for that."""
    import jaxlib
    return os.path.join(os.path.dirname(jaxlib.__file__), "include")


native = Pybind11Extension(
    "autopar._native",
    sorted(glob("native/src/*.cc") + glob("native/src/algorithms/*.cc")),
    cxx_std=17,
    # -isystem: the FFI headers' own warnings are not ours to fix (-Werror stays on for ours)
    extra_compile_args=["-isystem", xla_ffi_include()] + WARNINGS +
    (SANITIZE if sanitize else ["-O3"]),
    extra_link_args=SANITIZE[:1] if sanitize else [],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
