"""Build of the C extensions (metadata: pyproject.toml).

Two extensions from the same sources:

* attention_c._core, the one the package uses;
* attention_c._core_tests, the same binding compiled with ATT_TEST_HOOKS
  (csrc/binding_tests.c): it adds the tests' allocation-point counter,
  fault injection and the vector tanh entry, which _core does not have.

The kernels (every C file but the binding) are compiled once and linked
into both, so the second extension costs one more compile of binding.c.

Linux and macOS (x86-64 and arm64) with gcc or clang: the thread pool
(csrc/core/pool.c) uses POSIX threads, so there is no Windows build.
"""

import sys
from pathlib import Path

import numpy as np
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:                                   # setuptools >= 69
    from setuptools.modified import newer_group
except ImportError:                    # pragma: no cover
    from distutils.dep_util import newer_group

if sys.platform == "win32":
    sys.exit("attention_c does not build on Windows: its thread pool needs "
             "POSIX threads (supported: Linux and macOS, x86-64 and arm64)")

# -O3 but no CPU-specific -march: the wheel must run on any x86-64 (or
# arm64) CPU; faster instruction sets are chosen at run time.
compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra",
                "-fno-strict-aliasing", "-pthread"]
include_dirs = ["csrc", np.get_include()]

# Compiled once, shared by both extensions: every C file of the kernel
# layers (csrc/core, ref, simd, pooled, family), so that a new kernel file
# needs no edit here.  Sorted: the same link order on every machine.  The
# SIMD files set their own instruction set (target pragmas in
# csrc/simd/avx2.c, avx512.c; neon.c compiles to nothing off AArch64), so
# every file takes the same flags.
KERNEL_LAYERS = ["core", "ref", "simd", "pooled", "family"]
KERNEL_SOURCES = sorted(
    path.as_posix() for layer in KERNEL_LAYERS
    for path in Path("csrc", layer).glob("*.c"))
# Every header and template body (.inc) under csrc, so that editing one
# rebuilds what includes it (MANIFEST.in ships them all in the sdist).
HEADERS = sorted(path.as_posix() for pattern in ("*.h", "*.inc")
                 for path in Path("csrc").rglob(pattern))


class BuildExt(build_ext):
    """build_ext that compiles KERNEL_SOURCES once (when a source or a
    header is newer than its object) and links the objects into every
    extension."""

    def build_extensions(self):
        objects = self.compiler.object_filenames(
            KERNEL_SOURCES, output_dir=self.build_temp)
        stale = [src for src, obj in zip(KERNEL_SOURCES, objects)
                 if self.force or newer_group([src] + HEADERS, obj)]
        if stale:
            self.compiler.compile(stale, output_dir=self.build_temp,
                                  include_dirs=include_dirs,
                                  extra_postargs=compile_args,
                                  depends=HEADERS)
        for ext in self.extensions:
            ext.extra_objects = objects
            # a rebuilt kernel object relinks the extension; binding_tests.c
            # is binding.c, which includes the binding_*.h
            ext.depends = HEADERS + objects + ["csrc/binding.c",
                                               "csrc/binding_driver.h",
                                               "csrc/binding_views.h",
                                               "csrc/binding_module.h"]
        super().build_extensions()


def extension(name, source):
    return Extension(name, sources=[source], include_dirs=include_dirs,
                     extra_compile_args=compile_args)


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        extension("attention_c._core", "csrc/binding.c"),
        extension("attention_c._core_tests", "csrc/binding_tests.c"),
    ],
)
