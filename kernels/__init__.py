"""Triton kernels, installed as ``fused_transformer.kernels``: one op per module; ``toolchain`` says which Triton
releases they build with."""
from .._env import triton_interpreting

if triton_interpreting():
    from .toolchain import patch_interpreter

    patch_interpreter()
