"""minGPT-shaped: a Trainer class whose run() builds its own optimizer (and an LR scheduler); the
script saves the whole model with torch.save at the end and loads it back."""

import sys

import torch
from torch.utils.data import DataLoader

from sleepy import Net, SleepySGD, dataset, loss_fn, slow_collate


class Trainer:
    def __init__(self, model, data, max_iters):
        self.model, self.data, self.max_iters = model, data, max_iters

    def run(self):
        self.optimizer = SleepySGD(self.model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)
        loader = DataLoader(self.data, batch_size=4, collate_fn=slow_collate)
        it = iter(loader)
        for _ in range(self.max_iters):
            x, y = next(it)
            loss = loss_fn(self.model(x), y)
            self.model.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            sched.step()


if __name__ == "__main__":
    out = sys.argv[1]
    model = Net()
    Trainer(model, dataset(4 * 14), max_iters=14).run()
    torch.save(model, out)
    back = torch.load(out, weights_only=False)
    assert not back._forward_pre_hooks and "zero_grad" not in back.__dict__, "steptimer left hooks on the saved model"
    print("SAVED", type(back).__name__)
