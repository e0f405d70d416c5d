"""A torch.compile'd model (aot_eager: Dynamo and AOTAutograd without a C compiler), in a plain loop."""

import torch

from sleepy import Net, SleepySGD, loss_fn, nap

model = Net()
cmodel = torch.compile(model, backend="aot_eager")
opt = SleepySGD(model.parameters(), lr=0.01)
for i in range(12):
    nap("data")
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    loss = loss_fn(cmodel(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
