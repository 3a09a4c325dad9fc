"""Kernels on tree rows, each fast path with its slow, loop-based reference beside it.

- :mod:`~treepack.trainer.kernels.masks`: the tree mask (dense, FlexAttention BlockMask,
  varlen ancestor metadata), built from arrays (``subtree_end``, positions, segment tables);
- :mod:`~treepack.trainer.kernels.attention`: :func:`tree_attention` (sdpa | flex | flash);
- :mod:`~treepack.trainer.kernels.gdn` and :mod:`~treepack.trainer.kernels.gdn_ref`:
  Gated DeltaNet per tree depth level, and its pure-torch kernels;
- :mod:`~treepack.trainer.kernels.sparse`: top-k indexer attention on the ancestor chain;
- :mod:`~treepack.trainer.kernels.index`: torch-side index helpers;
- :mod:`~treepack.trainer.kernels.gpu`: the GPU mixer kernels (fla, mamba_ssm,
  causal-conv1d) wrapped for one tree level each, and which of them import here;
  :mod:`~treepack.trainer.kernels.gpu_varlen`: the same kernels behind the stock
  signatures (per-sequence states) for the mixers' ``select_*`` dispatch points.

GPU packages (flash-attn, flash-linear-attention, mamba_ssm, causal-conv1d, triton) are
imported only inside the functions that use them.
"""
