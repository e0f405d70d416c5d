"""Head-then-full fine-tuning: SGD on the head for STEPS steps, then a new AdamW on the whole model
for STEPS more (`python two_stages.py [STEPS]`)."""

from __future__ import annotations

import sys

import torch
from sleepy import Net, dataset
from torch import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 12
model = Net()
data = dataset(8)
x, y = torch.stack([a for a, _ in data]), torch.stack([b for _, b in data])


def train(opt: torch.optim.Optimizer) -> None:
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


model.body[0].requires_grad_(False)
train(torch.optim.SGD(model.body[2].parameters(), lr=0.01))
model.requires_grad_(True)
train(torch.optim.AdamW(model.parameters(), lr=1e-3))
print("TRAINED", 2 * steps)
