"""DCGAN-shaped: two networks, two optimizers, each network's zero_grad, D on real and fake batches."""

import torch
from torch import nn

from sleepy import SleepySGD, nap


class D(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


class G(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, z):
        nap("forward")
        return self.net(z)


if __name__ == "__main__":
    netD, netG = D(), G()
    optD = SleepySGD(netD.parameters(), lr=0.01)
    optG = SleepySGD(netG.parameters(), lr=0.01)
    crit = nn.BCEWithLogitsLoss()
    for i in range(12):
        nap("data")
        real = torch.randn(6, 8)
        netD.zero_grad()
        errD_real = crit(netD(real), torch.ones(6, 1))
        errD_real.backward()
        fake = netG(torch.randn(6, 4))
        errD_fake = crit(netD(fake.detach()), torch.zeros(6, 1))
        errD_fake.backward()
        optD.step()
        netG.zero_grad()
        errG = crit(netD(fake), torch.ones(6, 1))
        errG.backward()
        optG.step()
