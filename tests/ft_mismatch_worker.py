"""A --ft loop whose restarted replica builds a different model: it can never take its peers' state.

Used by tests/test_ft.py. Rank 1 exits (code 9) at step 30 of its first life;
restarted, it builds a wider model, so the state its peer sends does not fit.
"""
import os, sys, torch, torch.nn as nn
import ftrun.ft as ft
inc = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
hidden = 64 if inc == 0 else 96   # a restarted replica builds a different model: it can never heal
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 1))
ddp = ft.DistributedDataParallel(model)
opt = ft.Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.01))
for step in ft.steps(int(sys.argv[1])):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    opt.zero_grad(); ddp(x).pow(2).mean().backward(); opt.step()
    if step == 30 and os.environ["RANK"] == "1" and inc == 0:
        os._exit(9)
print("done", ft.global_step(), flush=True)
