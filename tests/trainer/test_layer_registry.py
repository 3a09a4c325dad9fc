"""The layer registry: one module per kind, read by check_model, the patching and the schedule.

A kind added from outside (``helpers.tiny_conv``: one module) is refused before it is
registered and handled, patched and exact on tree rows after; its conv may be narrower than
the plan's ``conv_width`` (exact: the context covers it) but not wider (refused, by
``check_model`` and by ``PackedBatch.tree_schedule``).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import treepack.trainer.hf.layers as layers
from treepack.proto.errors import RequestError, UnsupportedModelError
from treepack.trainer.data.materialize import materialize
from treepack.trainer.hf.admission.check import check_model
from treepack.trainer.hf.context import PackedContext, use_packed
from treepack.trainer.hf.layers import (
    TreeLayer,
    layer_of,
    patch_layers,
    register,
    registered,
    unpatch_layers,
    unregister,
)
from treepack.trainer.hf.layers.spec import ContextShard

from helpers.tiny_conv import TINY_CONV, TinyConvMixer
from helpers.trees import tree_plan

HIDDEN, VOCAB, PLAN_W = 8, 97, 4


def test_every_kind_module_is_registered_and_shards():
    found = []
    for info in pkgutil.iter_modules(layers.__path__):
        found += [k.kind for k in getattr(importlib.import_module(f"{layers.__name__}.{info.name}"), "LAYERS", ())]
    kinds = [k.kind for k in registered()]
    assert sorted(found) == sorted(kinds) and len(kinds) == len(set(kinds))
    assert {"gdn", "gdn_olmo", "kda", "mamba2", "mamba", "short_conv", "dsa", "glm_dsa", "dsa_indexer"} <= set(kinds)
    # Every built-in kind says how it runs under context parallelism (the CP oracle is
    # tests/e2e/test_trainer_cp_mixers.py).
    assert all(isinstance(k.shard, ContextShard) for k in registered())
    # Their patched forwards handle the shard themselves; every schedule-driven kind has a shard forward.
    assert sorted(k.kind for k in registered() if k.shard.forward is None) == ["dsa", "dsa_indexer", "glm_dsa"]


def test_cp_refuses_by_name_what_does_not_divide_and_what_has_no_shard():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from treepack.trainer.hf.admission.cp import check_cp_layers

    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    model = Qwen3_5ForCausalLM(cfg)
    check_cp_layers(model, 2)  # 2 key heads, 6 value heads: both divide
    with pytest.raises(
        UnsupportedModelError,
        match=r"linear_attn \(Qwen3_5GatedDeltaNet\): layer kind 'gdn' runs under CP on contiguous shards only",
    ):
        check_cp_layers(model, 2, contiguous=False)  # the all-gather plan's tiled split
    with pytest.raises(
        UnsupportedModelError,
        match=r"model.layers.0.linear_attn \(Qwen3_5GatedDeltaNet\): 6 value heads do not divide over 4",
    ) as e:
        check_cp_layers(model, 4)
    assert e.value.refusals == (("model.layers.0.linear_attn", "Qwen3_5GatedDeltaNet", e.value.refusals[0][2]),)
    kind = layer_of(model.model.layers[0].linear_attn)
    register(TreeLayer(kind="gdn_copy", classes=("Qwen3_5GatedDeltaNetCopy",), tree_forward=kind.tree_forward))
    try:
        copy = type("Qwen3_5GatedDeltaNetCopy", (type(model.model.layers[0].linear_attn),), {})
        model.model.layers[0].linear_attn.__class__ = copy
        with pytest.raises(UnsupportedModelError, match=r"layer kind 'gdn_copy' has no context-parallel path"):
            check_cp_layers(model, 2)
    finally:
        unregister("gdn_copy")


def test_a_kind_needs_one_way_to_run_and_to_be_recognised():
    with pytest.raises(TypeError, match="exactly one of tree_forward and patch"):
        TreeLayer(kind="x", classes=("X",))
    with pytest.raises(TypeError, match="recognised by nothing"):
        TreeLayer(kind="x", patch=lambda self: None)
    with pytest.raises(ValueError, match="registered already"):
        register(registered()[0])


@pytest.fixture(scope="module")
def case():
    seqs, _, plan = tree_plan(0, conv_width=PLAN_W)
    return seqs, materialize(plan, seqs, allow_empty_loss=True)


@pytest.fixture
def tiny_kind():
    register(TINY_CONV)
    try:
        yield TINY_CONV
    finally:
        unregister(TINY_CONV.kind)


def _model(width: int) -> torch.nn.Sequential:
    torch.manual_seed(width)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), TinyConvMixer(HIDDEN, width)).eval()


def _worst_diff(model, seqs, batch) -> float:
    with torch.no_grad(), use_packed(PackedContext(batch=batch)):
        packed = model(batch.input_ids)
    worst = 0.0
    with torch.no_grad():
        for s, ids in enumerate(seqs):
            alone = model(torch.as_tensor(ids, dtype=torch.int64)[None])[0]
            row, idx = batch.locate(s)
            worst = max(worst, float((packed[row, idx] - alone).abs().max()))
    return worst


@pytest.mark.parametrize("width", [2, PLAN_W])
def test_a_kind_from_one_module_is_checked_patched_and_exact(case, tiny_kind, width):
    seqs, batch = case
    model = _model(width)
    unregister(TINY_CONV.kind)  # before: a conv mixer nobody runs on trees, refused by mechanism
    with pytest.raises(UnsupportedModelError, match=r"1 \(TinyConvMixer\)"):
        check_model(model, conv_width=PLAN_W)
    register(TINY_CONV)
    assert check_model(model, conv_width=PLAN_W).handled == {"1": "mixer:tiny_conv"}
    assert _worst_diff(model, seqs, batch) > 1e-3  # negative control: the stock conv runs over whole rows
    assert patch_layers(model) == ["1"]
    assert _worst_diff(model, seqs, batch) < 1e-6
    assert unpatch_layers(model) == 1


def test_a_changed_forward_is_not_the_kind(tiny_kind):
    class Changed(TinyConvMixer):
        def forward(self, hidden_states, **kwargs):
            return super().forward(hidden_states) * 2

    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), Changed(HIDDEN, 2))
    with pytest.raises(UnsupportedModelError, match=r"Changed"):
        check_model(model, conv_width=PLAN_W)


def test_a_conv_wider_than_the_plan_is_refused(case, tiny_kind):
    seqs, batch = case
    model = _model(PLAN_W + 2)
    with pytest.raises(
        UnsupportedModelError, match=rf"kernel {PLAN_W + 2} but the plan was made with conv_width={PLAN_W}"
    ):
        check_model(model, conv_width=PLAN_W)
    patch_layers(model)
    with pytest.raises(RequestError, match=rf"TinyConvMixer .*kernel {PLAN_W + 2}.*conv_width={PLAN_W}") as info:
        _worst_diff(model, seqs, batch)
    assert info.value.path == "$.plan.gdn.conv_width"


def test_one_tree_schedule_per_batch(case):
    _, batch = case
    first = batch.tree_schedule()
    assert batch.tree_schedule(2, who="a") is first and batch.tree_schedule(PLAN_W) is first
    assert first.conv_width == PLAN_W
    with pytest.raises(RequestError, match=r"b: its causal conv has kernel 5"):
        batch.tree_schedule(PLAN_W + 1, who="b")
