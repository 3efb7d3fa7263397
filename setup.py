"""Install fused_transformer; the Triton code in kernels/ ships as fused_transformer.kernels.

torch is deliberately not pinned: GPU users bring the build that matches their CUDA.
"""
from setuptools import setup

setup(
    name="fused_transformer",
    version="0.1.0",
    description="Fused attention, LayerNorm and feed-forward kernels with drop-in torch.nn Transformer modules",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["fused_transformer", "fused_transformer.kernels"],
    package_dir={"fused_transformer": "fused_transformer", "fused_transformer.kernels": "kernels"},
    install_requires=["torch>=2.1", "numpy"],
    extras_require={
        "triton": ["triton>=3.0"],
        "test": ["pytest>=7", "triton>=3.0", "numpy"],
        "bench": ["pytest-benchmark", "matplotlib"],
    },
)
