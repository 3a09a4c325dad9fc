"""What TreepackFSDPEngine cannot do exactly is refused by name, before any compute; the switch."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from engines import build, build_critic, critic_batch, flags, grpo_batch, stock_registry
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

from treepack.proto.errors import RequestError
from treepack.trainer import verl_plugin
from treepack.trainer.verl import TreepackFSDPEngine, TreepackFSDPValueEngine


@pytest.fixture(scope="module")
def tree():
    return build(TreepackFSDPEngine)


def _refused(eng, td, what):
    calls = []
    hook = eng.module.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with eng.eval_mode(), pytest.raises(RequestError, match=f"TreepackFSDPEngine: {what}"):
            eng.infer_batch(td)
    finally:
        hook.remove()
    assert not calls, "the model ran before the refusal"


@pytest.mark.parametrize(
    "key", ["use_fused_kernels", "distillation_use_topk", "calculate_sum_pi_squared", "enable_routing_replay"]
)
def test_flag_refused(tree, key):
    td = flags(grpo_batch(), dynamic=False, rmpad=True, calculate_entropy=True, compute_loss=False)
    tu.assign_non_tensor(td, **{key: True})
    _refused(tree, td, key)


def test_per_sample_temperature_refused(tree):
    td = flags(grpo_batch(), dynamic=False, rmpad=True, calculate_entropy=True, compute_loss=False)
    td["temperature"] = torch.linspace(0.5, 1.0, td.batch_size[0])
    _refused(tree, td, "temperature")


def test_sft_batch_without_prompts_refused(tree):
    td = flags(grpo_batch(), dynamic=False, rmpad=True, compute_loss=False)
    del td["prompts"]
    _refused(tree, td, "prompts")


def test_ulysses_refused(tree):
    td = flags(grpo_batch(), dynamic=False, rmpad=True, compute_loss=False)
    tree.use_ulysses_sp = True
    try:
        with pytest.raises(RequestError, match="TreepackFSDPEngine: ulysses_sequence_parallel_size"):
            tree.forward_step(td, loss_function=None, forward_only=True)
    finally:
        tree.use_ulysses_sp = False


def test_critic_with_trl_value_head_is_refused():
    """verl's fallback critic (TRL's AutoModelForCausalLMWithValueHead: a ``v_head`` on a causal LM)
    is refused by name before the model runs; the critic on tree rows takes a token-classification model."""
    eng = build_critic(TreepackFSDPValueEngine)
    eng.module.v_head = torch.nn.Linear(4, 1)
    _refused(eng, flags(critic_batch(), dynamic=False, rmpad=True, compute_loss=False), "v_head")


def test_entry_point_registers_in_place_of_stock():
    """The ``verl.plugins`` entry point is installed; register() swaps every stock fsdp/fsdp2 entry."""
    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("treepack") == "treepack.trainer.verl_plugin", eps
    with stock_registry():
        assert not verl_plugin.registered()
        assert verl_plugin.register() is TreepackFSDPEngine and verl_plugin.registered()
        assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is TreepackFSDPEngine
        assert EngineRegistry.get_engine_cls("value_model", "fsdp2") is TreepackFSDPValueEngine
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", "fsdp2") is FSDPEngineWithValueHead


@pytest.mark.parametrize("switch", ["1", "0"])
def test_switch_through_import_verl(switch):
    """``import verl`` alone (as in every Ray worker) swaps the engine exactly when TREEPACK_VERL=1."""
    code = "import verl\nfrom treepack.trainer.verl_plugin import registered\nprint(registered())"
    env = {**os.environ, "TREEPACK_VERL": switch}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(switch == "1")
