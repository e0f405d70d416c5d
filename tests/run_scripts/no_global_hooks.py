"""No global module hook while steptimer runs a script, and a torch.compile'd model compiles as it
would without steptimer: no "global hooks on modules" warning (an error here) and one graph, compiled once. Checked before the model exists, after each call and each step, so every
state of discovery (watching the steps, models found, hooks in) is seen."""

import warnings

import torch
import torch.nn.modules.module as M

from sleepy import SleepySGD, loss_fn

GLOBAL = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
          "_global_backward_hooks", "_global_buffer_registration_hooks", "_global_module_registration_hooks",
          "_global_parameter_registration_hooks")  # fmt: skip


def check(where: str) -> None:
    held = {name: dict(getattr(M, name)) for name in GLOBAL if getattr(M, name)}
    assert not held, f"global module hooks {where}: {held}"


graphs = []


def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    graphs.append(gm)
    return gm.forward


check("before the model")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = SleepySGD(model.parameters(), lr=0.01)
check("after building the model")
with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".*global hooks on modules")
    cmodel = torch.compile(model, backend=counting)
    for i in range(8):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        out = cmodel(x)
        check(f"after forward {i}")
        loss_fn(out, y).backward()
        check(f"after backward {i}")
        opt.step()
        check(f"after step {i}")
        opt.zero_grad()
assert len(graphs) == 1, f"compiled {len(graphs)} graphs, expected 1"
print("NO GLOBAL HOOKS; GRAPHS", len(graphs))
