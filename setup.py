"""Build of the C extensions (metadata: pyproject.toml).

Two extensions from the same sources:

* attention_c._core, the one the package uses;
* attention_c._core_tests, the same binding (csrc/python/) compiled with
  ATT_TEST_HOOKS: it adds the tests' allocation-point counter, fault
  injection and the vector tanh entry, which _core does not have.

The kernels (every C file but the binding) are compiled once and linked
into both, so the second extension costs one more compile of the binding
(in a build folder of its own: the same sources make other objects).

Linux and macOS (x86-64 and arm64) with gcc or clang: the thread pool
(csrc/core/pool.c) uses POSIX threads, so there is no Windows build.
"""

import os
import sys
from pathlib import Path

import numpy as np
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, LinkError

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
# Every header and template body (.inc) of the kernels, so that editing
# one rebuilds what includes it (MANIFEST.in ships them all in the
# sdist); the binding's headers are below.
HEADERS = sorted(path.as_posix() for pattern in ("*.h", "*.inc")
                 for path in Path("csrc").rglob(pattern)
                 if path.parent.name != "python")


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
            # a rebuilt kernel object relinks the extension
            ext.depends = HEADERS + BINDING_HEADERS + objects
        super().build_extensions()

    def build_extension(self, ext):
        # the binding's objects of each extension in a folder of its own:
        # _core_tests compiles the same sources with other macros
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name)
        try:
            super().build_extension(ext)
        except (CompileError, LinkError):
            if LTO not in ext.extra_link_args:
                raise
            # a toolchain without link-time optimisation (clang without
            # its linker plugin): the same binding, a call a little slower
            ext.extra_compile_args.remove(LTO)
            ext.extra_link_args.remove(LTO)
            super().build_extension(ext)
        finally:
            self.build_temp = base


# The binding: the only C code that speaks CPython and NumPy.
BINDING_SOURCES = sorted(path.as_posix()
                         for path in Path("csrc", "python").glob("*.c"))
BINDING_HEADERS = sorted(path.as_posix()
                         for path in Path("csrc", "python").glob("*.h"))


# -flto: the binding is six files by concern, but one call runs through
# all of them; link-time optimisation inlines across them as the single
# file it was did (without it a tiny call cost 5% more, ~50 ns).
LTO = "-flto"


def extension(name, test_hooks=False):
    return Extension(name, sources=BINDING_SOURCES,
                     include_dirs=include_dirs,
                     define_macros=[("ATT_TEST_HOOKS", "1")] if test_hooks
                     else [],
                     extra_compile_args=compile_args + [LTO],
                     extra_link_args=[LTO])


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        extension("attention_c._core"),
        extension("attention_c._core_tests", test_hooks=True),
    ],
)
