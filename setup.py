"""Builds the optional C++ passes (src/cnns/kernels/norm_act.cpp) when the package is installed.

Everything else is in pyproject.toml. The extension is compiled once, at install time, never at run
time. Where it cannot be built (no C++ compiler, no torch headers) the install goes on without it and
cnns runs torch's own normalisation and activation modules (`cnns.kernels.norm_act.available()`).
"""

import platform
import sys

from setuptools import setup


def extensions():
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("cnns: torch is not importable at build time; installing without the fused kernels", file=sys.stderr)
        return [], {}
    # -fno-trapping-math: lets the compiler turn the activations' selects into vector blends.
    flags = ["-O3", "-fno-trapping-math"]
    if platform.machine() in ("x86_64", "AMD64"):
        # AVX2 + FMA: on every x86 CPU the project meets (AVX2-only EPYC, AVX-512 EPYC, AMX Xeon); the
        # passes are bound by memory, so wider vectors would not pay for a second build.
        flags.append("-march=x86-64-v3")
    ext = CppExtension("cnns.kernels._norm_act", ["src/cnns/kernels/norm_act.cpp"], extra_compile_args=flags)

    class OptionalBuildExtension(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as exc:  # no compiler or headers: the package still works, unfused
                print(f"cnns: the fused kernels were not built ({exc}); torch's modules will be used",
                      file=sys.stderr)

        def build_extension(self, extension):
            try:
                super().build_extension(extension)
            except Exception as exc:
                print(f"cnns: the fused kernels were not built ({exc}); torch's modules will be used",
                      file=sys.stderr)

    return [ext], {"build_ext": OptionalBuildExtension.with_options(use_ninja=False)}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
