"""pytorch/examples-mnist-shaped: argparse in main(), train() and test() per epoch, test under no_grad,
gradient accumulation, `if __name__ == '__main__': main()`; exits with --exit-code."""

import argparse
import sys

import torch
from torch.utils.data import DataLoader

from sleepy import Net, SleepySGD, dataset, loss_fn, slow_collate


def train(model, loader, optimizer, accum):
    model.train()
    for i, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y) / accum
        loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()


def test(model, loader):
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in loader:
            total += float(torch.nn.functional.mse_loss(model(x), y))
    print(f"test loss {total / len(loader):.3f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--exit-code", type=int, default=0)
    args = p.parse_args()
    print("ARGV", sys.argv[1:])
    model = Net()
    optimizer = SleepySGD(model.parameters(), lr=0.01)
    train_loader = DataLoader(dataset(48), batch_size=args.batch_size, collate_fn=slow_collate)
    test_loader = DataLoader(dataset(16), batch_size=args.batch_size, collate_fn=slow_collate)
    for _ in range(args.epochs):
        train(model, train_loader, optimizer, args.accum)
        test(model, test_loader)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
