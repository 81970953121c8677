"""Builds the optional C++ kernels (src/cnns/kernels/*.cpp) when the package is installed.

Everything else is in pyproject.toml. The kernels are plain shared libraries with a C ABI, loaded with ctypes
(cnns/kernels/__init__.py): they include no torch or Python header, so the build needs neither torch nor
more than a few seconds a library. They are compiled once, at install time, never at run time. Where they
cannot be built (no C++ compiler) the install goes on without them and cnns runs torch's own modules and
kernels (`cnns.kernels.norm_act.available()`, `cnns.kernels.depthwise.available()`,
`cnns.kernels.rounding.available()`), as a CPU run's header says. The region JPEG decoder
(`cnns.kernels.jpeg.available()`) also needs libjpeg-turbo's headers; without them whole images are decoded.
"""

import os
import platform
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def extensions():
    """The numeric kernels as plain shared libraries with a C ABI (cnns/kernels/__init__.py loads them with
    ctypes): no torch or Python header, so each compiles in seconds and the build needs no torch."""
    # -fno-trapping-math: lets the compiler turn the activations' selects into vector blends. -g0: no debug
    # information, which Python's own CFLAGS (-g) would otherwise add to every build.
    # -Wno-maybe-uninitialized: GCC 12 flags AVX-512's own intrinsics (`__m512i __Y = __Y;` in avx512fintrin.h)
    # 68 times under Python's -Wall; nothing of the kernels'.
    flags = ["-std=c++17", "-O3", "-g0", "-fno-trapping-math", "-Wno-maybe-uninitialized"]
    # -fopenmp: parallel.h's `#pragma omp parallel`. The library then needs libgomp.so.1, which resolves to the
    # one torch has already loaded (cnns.kernels imports torch first): one thread pool.
    link = []
    if sys.platform.startswith("linux"):
        flags.append("-fopenmp")
        link.append("-fopenmp")
    exts = []
    headers = ["src/cnns/kernels/vectors.h", "src/cnns/kernels/parallel.h"]  # a changed header rebuilds each
    for name in ("norm_act", "depthwise", "rounding"):
        source = [f"src/cnns/kernels/{name}.cpp"]
        if platform.machine() not in ("x86_64", "AMD64"):
            exts.append(Extension(f"cnns.kernels._{name}", source, depends=headers, extra_compile_args=flags,
                                  extra_link_args=link, language="c++"))
            continue
        # Two builds of the same kernels, chosen when imported (cnns.kernels.runnable_builds): AVX2 + FMA for
        # every x86 CPU the project meets, and AVX-512 with its bfloat16 conversions (AVX512-BF16) for the CPUs
        # with bfloat16 arithmetic (AVX512-BF16 or AMX, which have both). There the AVX2 build's bfloat16
        # conversions, done with integer operations, keep the memory-bound passes well below the memory
        # bandwidth that the AVX-512 build's native conversions reach. Both are built whatever this CPU is, so
        # a container moved to another host runs the build for that host.
        exts += [Extension(f"cnns.kernels._{name}", source, depends=headers,
                           extra_compile_args=flags + ["-march=x86-64-v3"], extra_link_args=link, language="c++"),
                 Extension(f"cnns.kernels._{name}_avx512", [f"src/cnns/kernels/{name}_avx512.cpp"],
                           depends=headers + source, extra_compile_args=flags + ["-march=x86-64-v4", "-mavx512bf16"],
                           extra_link_args=link, language="c++")]
    exts += _jpeg_extension()
    return exts, _build_ext()


def _jpeg_extension() -> list:
    """The region JPEG decoder (src/cnns/kernels/jpeg.cpp), where libjpeg-turbo's headers are found: in the
    compiler's own include path (Debian's libjpeg62-turbo-dev / libjpeg-dev) or in $CONDA_PREFIX/include
    (conda's libjpeg-turbo). Without them cnns decodes whole images with its general decoder."""
    include_dirs = _jpeg_include_dirs()
    if include_dirs is None:
        print("cnns: jpeglib.h not found (install libjpeg62-turbo-dev, libjpeg-dev or conda's libjpeg-turbo); "
              "installing without the region JPEG decoder", file=sys.stderr)
        return []
    library_dirs = [os.path.join(os.path.dirname(d), "lib") for d in include_dirs]
    flags = ["-std=c++17", "-O3", "-g0"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=x86-64-v3")  # the resize's vector loops; libjpeg-turbo picks its own SIMD at run time
    return [Extension("cnns.kernels._jpeg", ["src/cnns/kernels/jpeg.cpp"], include_dirs=include_dirs,
                      library_dirs=library_dirs, runtime_library_dirs=library_dirs, libraries=["jpeg"],
                      extra_compile_args=flags, language="c++")]


def _jpeg_include_dirs() -> list[str] | None:
    """[] where the C++ compiler finds jpeglib.h by itself, [$CONDA_PREFIX/include] where that holds it, else None."""
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    try:
        probe = subprocess.run([*compiler, "-E", "-x", "c++", "-"], input="#include <cstdio>\n#include <jpeglib.h>\n",
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return []
    except (OSError, subprocess.SubprocessError):
        pass
    conda = os.environ.get("CONDA_PREFIX")
    if conda and os.path.isfile(os.path.join(conda, "include", "jpeglib.h")):
        return [os.path.join(conda, "include")]
    return None


def _build_ext():

    class OptionalBuildExtension(build_ext):
        def finalize_options(self):
            super().finalize_options()
            # Seven builds of one source file each (each AVX-512 build has its own file, so no two write the
            # same object file): one per core at a time, with setuptools' threads.
            if self.parallel is None:
                self.parallel = os.cpu_count() or 1

        def run(self):
            try:
                super().run()
            except Exception as exc:  # no compiler or headers: the package still works, unfused
                print(f"cnns: the C++ kernels were not built ({exc}); torch's own will be used",
                      file=sys.stderr)

        def build_extension(self, extension):
            built = _built_in_place(self, extension)
            if built is not None:
                # `setup.py build_ext --inplace` already compiled it from these sources (the Makefile does, while
                # pip installs torch): an editable install's build, made in a temporary folder, takes that file.
                target = self.get_ext_fullpath(extension.name)
                if os.path.abspath(built) != os.path.abspath(target):
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.copy2(built, target)
                return
            try:
                super().build_extension(extension)
            except Exception as exc:
                print(f"cnns: the C++ kernels were not built ({exc}); torch's own will be used",
                      file=sys.stderr)

    return {"build_ext": OptionalBuildExtension}


def _built_in_place(command, extension) -> str | None:
    """The library `extension` compiled in the source tree, where it is newer than every source, header and
    this file (whose flags it was built with); else None."""
    package, _, name = extension.name.rpartition(".")
    path = os.path.join("src", *package.split("."), command.get_ext_filename(name))
    if not os.path.isfile(path):
        return None
    inputs = [*extension.sources, *extension.depends, __file__]
    built = os.path.getmtime(path)
    return path if all(os.path.getmtime(p) < built for p in inputs if os.path.exists(p)) else None


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
