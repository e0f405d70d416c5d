"""A plain DDP loop on gloo, for `torchrun -m steptimer run ddp.py`: one timer per rank, rank 0 writes."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from sleepy import Net, SleepySGD, loss_fn, nap

dist.init_process_group("gloo")
model = DDP(Net())
opt = SleepySGD(model.parameters(), lr=0.01)
for i in range(10):
    nap("data")
    loss = loss_fn(model(torch.randn(4, 8)), torch.randn(4, 1))
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"RANK {dist.get_rank()} DONE")
dist.destroy_process_group()
