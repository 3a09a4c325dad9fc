"""Kernels of the tree-packed trainer: each fast path with its naive reference beside it.

GPU packages (fla, mamba_ssm, causal_conv1d, triton) are imported lazily, inside
:mod:`treepack.trainer.kernels.gpu`'s functions.
"""
