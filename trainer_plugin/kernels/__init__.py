"""Token-mixing kernels of the trainer, each fast path with its loop-based reference beside it."""
