"""The forward's options as one object: :class:`PackedSetup`, created once per packed call.

:func:`~treepack.trainer.hf.packed_forward` takes its options as keywords (``backend``,
``output``, ``varlen_fn``, ``compile``, ``patch_layers``, ``verify``, ``allow_dropout``,
``allow_stochastic``) and
reads the rest of what the model's admission depends on from the batch (the row length, the
plan's GDN ``conv_width``, the context-parallel split) and from the model-call keywords. They
are validated here once, and the one frozen object travels through the admission (the
static check, the walk cache, the probe) and the packed run.

Its keys are the walk cache's (:mod:`~treepack.trainer.hf.admission.walk_cache`): the setup
with the options a walk does not read blanked out is the key of the model walk
(:meth:`PackedSetup.walk_key`), and the probe's key also holds the model's numerics
(:meth:`PackedSetup.probe_key`). ``varlen_fn`` is a callable: it hashes by identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.hf.admission.probe_inputs import probe_shape
from treepack.trainer.hf.wrapped import wrapper_chain
from treepack.trainer.kernels.attention import BACKENDS

__all__ = ["PackedSetup", "OUTPUTS", "kwargs_key", "numerics"]

OUTPUTS = ("logits", "hidden")


def kwargs_key(kwargs: dict) -> tuple:
    """The model-call keyword arguments as part of a setup key (values that are not plain: by type)."""
    return tuple(
        sorted(
            (k, v if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__)
            for k, v in kwargs.items()
        )
    )


def numerics(hf: torch.nn.Module) -> tuple:
    """What a probe depends on beyond the model's modules: dtype and device of its
    parameters, gradient mode, autocast (:func:`~treepack.trainer.hf.admission.probe.probe_signature`)."""
    p = next(hf.parameters(), None)
    dev = p.device.type if p is not None else "cpu"
    autocast = str(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
    return (
        str(p.dtype) if p is not None else "",
        str(p.device) if p is not None else "",
        torch.is_grad_enabled(),
        autocast,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedSetup:
    """The options of one packed forward (see :func:`~treepack.trainer.hf.packed_forward`).

    Attributes:
        backend: ``sdpa`` | ``flex`` | ``flash``.
        output: ``logits`` | ``hidden``.
        varlen_fn: ``flash`` backend kernel override (hashed by identity).
        compile: ``flex`` backend: compile ``flex_attention`` (None: on CUDA).
        patch_layers: patch the registry's layers for tree rows.
        verify: run the probe on the first call of a setup.
        allow_dropout: accept dropout outside attention while training (not exact).
        allow_stochastic: accept other random draws while training (router jitter, sampling
            routers, layerdrop; not exact).
        row_len: the packed rows' length (``batch.plan.seq_len``); None when no batch is known.
        conv_width: the plan's GDN conv width; None: not checked.
        cp_size: context-parallel ranks of the batch (0: no CP).
        cp_contiguous: the CP split gives each rank contiguous shards.
        call_kwargs: the model-call keywords as :func:`kwargs_key` gives them.

    Raises:
        RequestError: ``backend`` or ``output`` is not one of the known values.
    """

    backend: str = "sdpa"
    output: str = "logits"
    varlen_fn: Callable | None = None
    compile: bool | None = None
    patch_layers: bool = True
    verify: bool = True
    allow_dropout: bool = False
    allow_stochastic: bool = False
    row_len: int | None = None
    conv_width: int | None = None
    cp_size: int = 0
    cp_contiguous: bool = True
    call_kwargs: tuple = ()

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise RequestError(
                f"backend must be one of {BACKENDS}, got {self.backend!r}", path="$.backend", rule="enum"
            )
        if self.output not in OUTPUTS:
            raise RequestError(f"output must be one of {OUTPUTS}, got {self.output!r}", path="$.output", rule="enum")
        for name in ("patch_layers", "verify", "allow_dropout", "allow_stochastic", "cp_contiguous"):
            object.__setattr__(self, name, bool(getattr(self, name)))

    @classmethod
    def of_call(cls, batch: Any, kwargs: dict[str, Any], **options: Any) -> PackedSetup:
        """The setup of a packed call of ``batch`` with the model-call keywords ``kwargs``.

        Args:
            batch: the :class:`~treepack.trainer.data.packed_batch.PackedBatch` (its row
                length, conv width and CP split are part of the setup).
            kwargs: the keywords passed to ``model(...)``.
            **options: the forward's options (the fields ``backend`` ... ``allow_stochastic``).

        Returns:
            The validated :class:`PackedSetup`.
        """
        cp = batch.cp
        return cls(
            **options,
            row_len=batch.plan.seq_len,
            conv_width=batch.plan.gdn.conv_width,
            cp_size=cp.size if cp is not None else 0,
            cp_contiguous=batch.plan.ranks.contiguous if cp is not None else True,
            call_kwargs=kwargs_key(kwargs),
        )

    @property
    def kwargs(self) -> dict[str, Any]:
        """The model-call keywords the setup keyed on (values not plain: their type's name)."""
        return dict(self.call_kwargs)

    def walk_key(self) -> PackedSetup:
        """The key of the model walk: this setup without what the walk does not read
        (the kernel override, compilation, whether the probe runs)."""
        return dataclasses.replace(self, varlen_fn=None, compile=None, verify=True)

    def probe_key(self, hf: torch.nn.Module, model: Any = None) -> tuple:
        """The key of the probe: the options the probe runs with (backend, layer patches, conv
        width, dropout and random draws accepted), the cap the rows put on the probe's
        sequences (:func:`~treepack.trainer.hf.admission.probe_inputs.probe_shape`), the
        wrappers of ``model`` it runs through and ``hf``'s :func:`numerics`; the output, CP
        split and call keywords of the caller's batch are not part of it."""
        proven = PackedSetup(
            backend=self.backend,
            patch_layers=self.patch_layers,
            conv_width=self.conv_width,
            allow_dropout=self.allow_dropout,
            allow_stochastic=self.allow_stochastic,
        )
        cap = probe_shape(hf, self.row_len)[1]
        return ("probe", proven, cap, wrapper_chain(hf if model is None else model), *numerics(hf))
