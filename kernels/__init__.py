"""Triton kernels, installed as ``fused_transformer.kernels``: one op per module."""
