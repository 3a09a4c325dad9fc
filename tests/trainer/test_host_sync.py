"""After ``materialize`` the packed forward, the losses and the backward never wait on the
device: no ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, Python scalar conversions,
or data-dependent shapes (``nonzero``, boolean indexing, ``unique``, ``masked_select``).

On a GPU each of these stalls the stream; on the CPU they are free, so the test counts them:
a TorchFunctionMode sees the Tensor methods, a TorchDispatchMode the aten ops. The varlen
kernel stand-ins (the CPU kernels that take flash-attn's place, whole or as the split
forward/backward pair of the copy-free path) read ``cu_seqlens`` on the host by design and are
the one place left out.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from treepack.service.planner import plan_batch
from treepack.trainer import materialize, packed_forward
from treepack.trainer.hf.admission.guards import trust_hook
from treepack.trainer.kernels.varlen import varlen_attention
from treepack.trainer.losses import sft_loss

SYNC_METHODS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "is_nonzero", "aten.equal")
STAND_INS = {
    "varlen_attention",
    "naive_varlen_attention",
    "split_forward",
    "split_backward",
    "_naive_forward",
    "_naive_backward",
}


def _site() -> tuple[str, int, str] | None:
    """The innermost treepack frame of the current call, or None inside the kernel stand-in."""
    frames = [
        f for f in traceback.extract_stack() if "/torch/" not in f.filename and "test_host_sync" not in f.filename
    ]
    if any(f.name in STAND_INS for f in frames):
        return None
    ours = [f for f in frames if "treepack" in f.filename or "trainer_plugin" in f.filename]
    f = ours[-1] if ours else frames[-1]
    return (f.filename.rsplit("/", 2)[-1], f.lineno, f.line or "")


class SyncCounter:
    """Counts host syncs by call site (both modes at once)."""

    def __init__(self) -> None:
        self.sites: collections.Counter = collections.Counter()
        counter = self

        class Fn(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in SYNC_METHODS:
                    counter._hit(func.__name__)
                return func(*args, **(kwargs or {}))

        class Disp(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if any(k in name for k in SYNC_OPS):
                    counter._hit(name)
                elif name.startswith("aten.index.Tensor") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()
                ):
                    counter._hit("boolean index")
                return func(*args, **(kwargs or {}))

        self._modes = (Fn(), Disp())

    def _hit(self, what: str) -> None:
        site = _site()
        if site is not None:
            self.sites[(what, *site)] += 1

    def __enter__(self) -> SyncCounter:
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    return Qwen3ForCausalLM(cfg).float()


SEQS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 9, 8, 7, 6, 5], [3, 4, 5, 6, 7], [3, 4, 5, 6, 9, 9]]


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("normalization", ["token", "sequence", "group"])
def test_packed_step_makes_no_host_sync_after_materialize(backend, normalization):
    model = tiny_qwen3()
    plan = plan_batch(SEQS, trainable=[4, 4, 2, 3], groups=[0, 0, 1, 1], seq_len=32, min_shared_len=2)
    batch = materialize(plan, SEQS)
    kw = dict(backend=backend, varlen_fn=varlen_attention if backend == "flash" else None)
    packed_forward(model, batch, **kw)  # the first call walks the model: not what is counted
    with SyncCounter() as sync:
        logits = packed_forward(model, batch, **kw)
        loss = sft_loss(batch.target_logprobs(logits), batch, normalization=normalization)
        loss.backward()
    assert not sync.sites, "host syncs after materialize:\n" + "\n".join(f"{n} x {s}" for s, n in sync.sites.items())
    assert torch.isfinite(loss)


def test_the_counter_sees_each_kind_of_sync():
    x = torch.arange(6.0)
    with SyncCounter() as sync:
        x.sum().item()
        float(x.max())
        x.tolist()
        x[x > 2]
        torch.nonzero(x)
        x.cpu()
    kinds = {k[0] for k in sync.sites}
    assert {
        "item",
        "__float__",
        "tolist",
        "boolean index",
        "aten.nonzero.default",
        "cpu",
        "aten._local_scalar_dense.default",
    } <= kinds, kinds


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_kernel_metadata_is_ready_before_the_first_layer(backend):
    model = tiny_qwen3()
    plan = plan_batch(SEQS, trainable=[4, 4, 2, 3], seq_len=32, min_shared_len=2)
    batch = materialize(plan, SEQS)
    seen = []
    # A recording hook that mixes no positions: declared as such, so the guards accept it.
    model.model.layers[0].register_forward_pre_hook(
        trust_hook(lambda mod, args: seen.append(sorted(map(str, batch._cache))))
    )
    before = sorted(map(str, batch._cache))
    # verify=False: the run-time probe would call layer 0 on batches of its own first.
    packed_forward(model, batch, backend=backend, varlen_fn=varlen_attention, verify=False)
    assert len(seen) == 1 and seen[0] == sorted(map(str, batch._cache)), (before, seen, sorted(map(str, batch._cache)))
    assert seen[0] != before  # the mask or varlen metadata was built, before layer 0


def test_tree_schedule_is_ready_before_the_first_layer():
    from treepack.trainer.hf.layers import handled_layer

    from helpers.families import model_support
    from helpers.mixers import mixer_case

    model = model_support().build_causal_lm("mamba2")
    _, _, plan, batch = mixer_case(4)
    first = next(m for m in model.modules() if handled_layer(m) is not None)
    seen = []
    first.register_forward_pre_hook(trust_hook(lambda mod, args: seen.append("tree_schedule" in batch._cache)))
    assert "tree_schedule" not in batch._cache
    packed_forward(model, batch, verify=False)
    assert seen and seen[0], "the first recurrent layer built the tree schedule mid-forward"
