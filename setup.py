"""Install fused_transformer; the Triton code in kernels/ ships as fused_transformer.kernels, and the C++ CPU
kernels in csrc/ build into fused_transformer._C when torch and a C++ compiler are present at build time.

torch is deliberately not pinned: GPU users bring the build that matches their CUDA, and with it the Triton that
build pins. The floors are the oldest pair CI tests (torch 2.11 with its Triton 3.6; kernels/toolchain.py).
Building the extension against the installed torch needs ``pip install --no-build-isolation`` (pip's isolated
build environment would fetch a separate, possibly CUDA, torch). Without torch or a compiler the package installs
without the extension and falls back to the PyTorch reference on CPU.
"""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

TORCH_FLOOR = "torch>=2.11"
TRITON_FLOOR = "triton>=3.6"
# The transformers release the [hf] extra is checked against (fused_transformer.integrations); the tests install the
# first release that brings the PyPI package `kernels`, whose name our kernels/ folder must never answer for
# (tests/test_kernels_name.py).
TRANSFORMERS_FLOOR = "transformers>=5.23"
TRANSFORMERS_TESTED = "transformers>=5.25"
# Every package under fused_transformer/, and the Triton code under kernels/ as fused_transformer.kernels.
PACKAGES = (["fused_transformer", *(f"fused_transformer.{p}" for p in find_packages("fused_transformer")),
             "fused_transformer.kernels", *(f"fused_transformer.kernels.{p}" for p in find_packages("kernels"))])


def _cpu_extension():
    """(ext_modules, cmdclass) for fused_transformer._C, or empty ones with a printed reason."""
    if os.environ.get("FUSED_TRANSFORMER_SKIP_CPU_BUILD") == "1":
        return _skip("FUSED_TRANSFORMER_SKIP_CPU_BUILD=1")
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        return _skip(f"torch is not importable at build time ({exc}); install torch first and use "
                     "pip install --no-build-isolation")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler.split()[0]) is None:
        return _skip(f"no C++ compiler ({compiler!r} not found)")
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "*.cpp")))
    # -march stays generic (portable wheels); csrc/common.h compiles the hot loops for AVX2 as well and picks
    # at load time. OpenMP as torch itself uses it, so at::parallel_for runs on torch's thread pool.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    extension = CppExtension(
        name="fused_transformer._C",
        sources=sources,
        extra_compile_args=["-O3", "-g0", "-Wno-psabi", *openmp],
        extra_link_args=openmp,
    )

    class OptionalBuildExtension(BuildExtension):
        """A failed compile leaves the package installable: it then runs on the PyTorch reference on CPU."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 (any compiler or linker failure)
                if os.environ.get("FUSED_TRANSFORMER_REQUIRE_CPU") == "1":
                    raise
                _skip(f"the build failed ({type(exc).__name__}: {exc})")

    options = dict(use_ninja=shutil.which("ninja") is not None)
    return [extension], {"build_ext": OptionalBuildExtension.with_options(**options)}


def _skip(reason):
    print(f"fused_transformer: not building the C++ CPU extension: {reason}", file=sys.stderr)
    return [], {}


ext_modules, cmdclass = _cpu_extension()

setup(
    name="fused_transformer",
    version="0.1.0",
    description="Fused attention, LayerNorm and feed-forward kernels with drop-in torch.nn Transformer modules",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir={"fused_transformer": "fused_transformer", "fused_transformer.kernels": "kernels"},
    # The variant rows the plans read (kernels/variants.py), written by bench --suite variants on a GPU.
    package_data={"fused_transformer.kernels": ["variant_rows.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[TORCH_FLOOR, "numpy", "tqdm"],
    extras_require={
        "triton": [TRITON_FLOOR],
        "hf": [TRANSFORMERS_FLOOR],
        "test": ["pytest>=7", "pytest-xdist", TRITON_FLOOR, TRANSFORMERS_TESTED, "numpy", "matplotlib"],
        "bench": ["pytest-benchmark", "matplotlib"],
    },
)
