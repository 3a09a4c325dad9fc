"""Torch-side index helpers shared by the kernels and the data layer.

The numpy side (ragged ranges, CSR gathers, local row index, flat position maps) lives in
:mod:`treepack.proto.index`; these move its results onto a device and scatter into
buffers whose unwritten slots show (NaN for floating dtypes, -1 for integers, False for
bool), as the house style asks of every output buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["index_tensor", "fill_value", "scatter_filled"]


def index_tensor(a: np.ndarray, device: Any = None, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A numpy index array as a contiguous tensor of ``dtype`` on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)


def fill_value(dtype: torch.dtype) -> Any:
    """What an unwritten slot of ``dtype`` holds: NaN (floating, complex), False (bool), -1 (integer)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else -1


def scatter_filled(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """[size, ...] buffer of :func:`fill_value`, ``values`` written at ``index`` (differentiable).

    Args:
        values: [n, ...] the entries.
        index: [n] int64 distinct positions in [0, size).
        size: the buffer's first dimension.
    """
    out = torch.full((size, *values.shape[1:]), fill_value(values.dtype), dtype=values.dtype, device=values.device)
    return out.index_put((index,), values)
