"""Kernels on tree rows, each fast path with its slow, loop-based reference beside it.

Names: ``naive_*`` is a loop-based reference with the fast path's signature (tests compare
the two); ``torch_*`` is a pure-torch implementation of a GPU kernel's contract (the CPU
path of a ``select_*`` dispatch point, e.g. :func:`~treepack.trainer.kernels.mamba.torch_selective_scan`
for mamba_ssm's ``selective_scan_fn``); ``tree_*`` runs on tree rows.

- :mod:`~treepack.trainer.kernels.masks`: the tree mask (dense, FlexAttention BlockMask,
  varlen ancestor metadata), built from arrays (``subtree_end``, positions, segment tables);
  the BlockMask itself, pruned to the blocks the tree, the window and the chunk leave
  visible, in :mod:`~treepack.trainer.kernels.blocks`;
- :mod:`~treepack.trainer.kernels.attention`: :func:`tree_attention` (sdpa | flex | flash);
  the flash backend's copy-free calls, one per tree level
  (:mod:`~treepack.trainer.kernels.varlen_levels`), merged by log-sum-exp through a split
  forward/backward pair (:mod:`~treepack.trainer.kernels.varlen_merge`; the batched CPU
  kernel :mod:`~treepack.trainer.kernels.varlen`, flash-attn's in
  :mod:`~treepack.trainer.kernels.gpu_flash`);
- :mod:`~treepack.trainer.kernels.gdn` and :mod:`~treepack.trainer.kernels.gdn_ref`:
  Gated DeltaNet per tree depth level, and its pure-torch kernels;
- :mod:`~treepack.trainer.kernels.sparse`: top-k indexer attention on the ancestor chain;
- :mod:`~treepack.trainer.kernels.index`: torch-side index helpers;
- :mod:`~treepack.trainer.kernels.tree_scan`: the one tree-scan mechanism of every recurrent
  or conv mixer (per depth level one varlen conv and one varlen scan, forked states), with
  the mixer families' references beside it: :mod:`~treepack.trainer.kernels.short_conv`
  (causal conv, LFM2's gated short conv), :mod:`~treepack.trainer.kernels.mamba2` (SSD),
  :mod:`~treepack.trainer.kernels.mamba` (selective scan), :mod:`~treepack.trainer.kernels.kda`;
- :mod:`~treepack.trainer.kernels.gpu`: the GPU mixer kernels (fla, mamba_ssm,
  causal-conv1d) wrapped for one tree level each, and which of them import here (the
  state-space ones, as padded batches, in :mod:`~treepack.trainer.kernels.gpu_ssm`);
  :mod:`~treepack.trainer.kernels.gpu_varlen`: the same kernels behind the stock
  signatures (per-sequence states) for the mixers' ``select_*`` dispatch points.

GPU packages (flash-attn, flash-linear-attention, mamba_ssm, causal-conv1d, triton) are
imported only inside the functions that use them.
"""
