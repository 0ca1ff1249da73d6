"""Build of the C extension attention_c._core (metadata: pyproject.toml).

Linux and macOS (x86-64 and arm64) with gcc or clang: the thread pool
(csrc/pool.c) uses POSIX threads, so there is no Windows build.
"""

import sys

import numpy as np
from setuptools import Extension, setup

if sys.platform == "win32":
    sys.exit("attention_c does not build on Windows: its thread pool needs "
             "POSIX threads (supported: Linux and macOS, x86-64 and arm64)")

# -O3 but no CPU-specific -march: the wheel must run on any x86-64 (or
# arm64) CPU; faster instruction sets are chosen at run time.
compile_args = ["-std=c11", "-O3", "-Wall", "-Wextra",
                "-fno-strict-aliasing", "-pthread"]

setup(
    ext_modules=[
        Extension(
            "attention_c._core",
            sources=["csrc/binding.c", "csrc/kernels.c", "csrc/pool.c",
                     "csrc/fast_avx2.c", "csrc/fast_avx512.c",
                     "csrc/fast_neon.c"],
            # Every header, so that editing one rebuilds the extension
            # (MANIFEST.in ships them all in the sdist).
            depends=["csrc/attention.h", "csrc/kernels_impl.h",
                     "csrc/fast.h", "csrc/fast_impl.h", "csrc/pool.h",
                     "csrc/family_impl.h", "csrc/fast_ops_impl.h"],
            include_dirs=["csrc", np.get_include()],
            extra_compile_args=compile_args,
        )
    ],
)
