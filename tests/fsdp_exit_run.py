"""One two-process run that ends as a sharded training script does, for tests/test_distributed.py: FSDP2
(``fully_shard`` on a tiny GPT-2's blocks and root) over gloo, two steps, the full state dict gathered and saved by rank
0, then — the amplifier — an all-gather left in flight, and :func:`trl_userdp.distributed.finish`. Without ``finish``
(``python tests/fsdp_exit_run.py plain``: a barrier, then exit) about one launch in four aborts at interpreter shutdown
("terminate called without an active exception")."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

from trl_userdp.distributed import finish

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=128))
mesh = init_device_mesh("cpu", (world,))
for block in model.transformer.h:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(2):
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(10 * rank + step))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:
    with tempfile.TemporaryDirectory() as folder:
        torch.save(state, os.path.join(folder, "model.pt"))
# a collective still queued when the last barrier is: the barrier keeps a weak reference to it
dist.all_gather_into_tensor(torch.empty(1000 * world), torch.randn(1000), async_op=True)
if sys.argv[1:] == ["plain"]:
    dist.barrier()
else:
    finish()
