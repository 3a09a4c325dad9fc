"""One context-parallel training step on tree rows: docs/context-parallel.md's example, as a file.

    torchrun --nproc-per-node 2 examples/cp_step.py

Two CPU processes (gloo) split every row of a tiny Qwen3 in two shards; each prints its part.
"""

import numpy as np
import torch
import torch.distributed as dist
import transformers as tf

from treepack.service.planner import plan_batch
from treepack.trainer import ContextParallel, materialize
from treepack.trainer.hf import packed_forward
from treepack.trainer.losses import ppo_clip_loss

dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_*
cp = ContextParallel(dist.group.WORLD)  # the ranks that split every row
torch.manual_seed(0)
cfg = tf.Qwen3Config(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
model = tf.Qwen3ForCausalLM(cfg).float()
rng = np.random.default_rng(0)
prompt = rng.integers(0, 97, 24)
sequences = [np.concatenate([prompt, rng.integers(0, 97, n)]) for n in (6, 9, 5, 8)]
old = [rng.normal(-4.6, 0.3, len(s)) for s in sequences]
plan = plan_batch(sequences, seq_len=64, min_shared_len=16, trainable=[24] * 4, groups=[0] * 4, cp_size=cp.size)
batch = materialize(plan, sequences, payloads={"old": old}, cp=cp)  # [rows, shard_len] on each rank
logits = packed_forward(model, batch)  # CP attention inside; this shard's logits
adv = torch.tensor([1.0, -0.5, 0.25, -0.75])
loss = ppo_clip_loss(batch.target_logprobs(logits), batch, advantages=adv, old_logprobs="old", normalization="sequence")
loss.backward()  # this shard's part: normalized over the whole batch
for p in model.parameters():
    dist.all_reduce(p.grad)  # summed over the group: the one-process gradient
per_seq = batch.unpack_logprobs(logits.detach())  # every sequence whole, on every rank
print(f"rank {cp.rank} of {cp.size}: shard {tuple(batch.input_ids.shape)}, {len(per_seq)} sequences unpacked")
dist.destroy_process_group()
