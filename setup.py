"""Optional native extension for lmsrt; metadata lives in pyproject.toml.

``lmsrt._native`` only accelerates the offset allocator, and lmsrt.arena falls
back to a pure-Python allocator with identical behaviour, so a failed compile
(no compiler, no pybind11, unsupported platform) must not fail the install.
"""

import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

GCC_STYLE_FLAGS = ["-O2", "-std=c++17"]
MSVC_FLAGS = ["/O2", "/std:c++17"]


class OptionalBuildExt(build_ext):
    """build_ext that reports a failed native build in one line instead of failing."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - compiler, linker, missing toolchain alike
            reason = (str(exc).splitlines() or [""])[0]
            print(f"lmsrt: native extension not built ({type(exc).__name__}: {reason}); "
                  "the pure-Python allocator will be used")

    def build_extension(self, ext: Extension) -> None:
        # Imported here so that a missing pybind11 is just another build failure.
        import pybind11

        ext.include_dirs.append(pybind11.get_include())
        flags = MSVC_FLAGS if self.compiler.compiler_type == "msvc" else GCC_STYLE_FLAGS
        ext.extra_compile_args.extend(flags)
        super().build_extension(ext)


class BuildPyWithCopyPath(build_py):
    """build_py that also puts csrc/copy_path.cpp in the package (``lmsrt/_csrc/``): a wheel
    then carries the source that ``lmsrt.copy_path`` compiles on a GPU's first use (or ``lmsrt
    build``). An editable install reads csrc/ of the checkout instead."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, "lmsrt", "_csrc")
        os.makedirs(target, exist_ok=True)
        shutil.copy2(os.path.join("csrc", "copy_path.cpp"), target)


setup(
    ext_modules=[
        Extension(
            "lmsrt._native",
            sources=["csrc/offset_allocator.cpp"],
            language="c++",
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithCopyPath},
)
