"""Builds a model and only evaluates it; exits with the status given (or raises with 'raise')."""

import sys

import torch

from sleepy import Net

model = Net()
with torch.no_grad():
    model(torch.randn(4, 8))
if sys.argv[1:] == ["raise"]:
    raise ValueError("the script's own error")
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
