"""What a port to --ft can get wrong without a word, said in one line through the real CLI: replicas
whose datasets differ (an unseeded random_split), an empty dataset, a shuffle that is not what the
script's DistributedSampler did; and the sampler itself, kept in the port (ft.DataLoader takes its
shuffle, seed and drop_last) and usable for an evaluation loader on every replica, restarted ones
included. Each test writes a small script into tmp_path."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from conftest import run_ftrun
from test_ft import _run_killing

HEAD = """
import json, os, sys
import torch
import ftrun.ft as ft
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset, random_split

torch.manual_seed(int(os.environ["RANK"]))   # each worker its own random state, as ftrun gives it
full = TensorDataset(torch.arange(64, dtype=torch.float32).unsqueeze(1))
model = ft.DistributedDataParallel(torch.nn.Linear(1, 1, bias=False))
opt = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.0))


def train(loader, epochs=2, out=None, sleep=0.0):
    seen = []
    for epoch in ft.epochs(epochs):
        for (x,) in loader:
            opt.zero_grad()
            model(x).sum().backward()
            if opt.step():
                seen.append([epoch] + x.flatten().int().tolist())
            if sleep:
                import time; time.sleep(sleep)
    if out:
        with open(f"{out}.rank{os.environ['RANK']}.json", "w") as f:
            json.dump(seen, f)
"""


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(HEAD + textwrap.dedent(body))
    return path


def _one_line(proc, needle: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if needle in line]
    assert lines, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[-1]


def test_an_unseeded_random_split_stops_the_run_in_one_line(ftrun_home, tmp_path):
    """random_split without a generator gives every worker another split of the same length: the
    replicas would train different samples and "every sample once an epoch" would be false. Each
    worker compares the Subset's indices with the first worker's as it builds the loader, and the
    run stops in one line naming the split."""
    script = _script(tmp_path, """
        train_set, _ = random_split(full, [48, 16])
        train(ft.DataLoader(train_set, batch_size=4, shuffle=True))
    """)
    proc = run_ftrun(["--nproc", 2, "--ft", script], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc, "dataset")
    assert "random_split" in line and "generator=" in line, line


def test_the_workers_of_one_replica_compare_a_split_wrapped_in_a_transform(ftrun_home, tmp_path):
    """One replica of two sharded workers (data parallel inside the replica), over an unseeded
    random_split that a transform dataset wraps, as scripts wrap a split: no heal ever compares
    two workers of one replica, and the Subset is one level down. The run stops in one line before
    its first step; before, both workers trained to the end on their own splits."""
    out = tmp_path / "w"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        import ftrun.ft as ft
        from torch.distributed.fsdp import fully_shard
        from torch.utils.data import Dataset, TensorDataset, random_split

        class Shifted(Dataset):
            def __init__(self, split):
                self.split = split
            def __len__(self):
                return len(self.split)
            def __getitem__(self, i):
                return (self.split[i][0] + 0.5,)

        train_set, _ = random_split(TensorDataset(torch.arange(64, dtype=torch.float32).unsqueeze(1)), [48, 16])
        model = torch.nn.Linear(1, 1, bias=False)
        fully_shard(model, mesh=ft.device_mesh())
        model = ft.replicate(model)
        opt = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
        loader = ft.DataLoader(Shifted(train_set), batch_size=4, shuffle=True)
        for epoch in ft.epochs(1):
            for (x,) in loader:
                opt.zero_grad()
                model(x).sum().backward()
                if opt.step():
                    open({str(out)!r}, "a").write("stepped\\n")
    """))
    proc = run_ftrun(["--nproc", 2, "--ft", "--replica-size", 2, script], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc, "dataset")
    assert "rank " in line and "Subset" in line and "random_split" in line, line
    assert not out.exists(), proc.stderr[-3000:]


def test_replicas_whose_datasets_differ_in_length_stop_in_one_line(ftrun_home, tmp_path):
    script = _script(tmp_path, """
        train(ft.DataLoader(Subset(full, range(40 + int(os.environ["RANK"]))), batch_size=4))
    """)
    proc = run_ftrun(["--nproc", 2, "--ft", script], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc, "dataset")
    assert "40" in line and "41" in line and "random_split" in line, line


def test_an_empty_dataset_is_one_line(ftrun_home, tmp_path):
    script = _script(tmp_path, """
        train(ft.DataLoader(Subset(full, []), batch_size=4, shuffle=True))
    """)
    proc = run_ftrun(["--nproc", 2, "--ft", script], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc, "empty")
    assert line.startswith("ftrun: rank ") and "0 samples" in line, line


def test_a_shuffle_other_than_the_scripts_sampler_is_said_once(ftrun_home, tmp_path):
    """The script kept its DistributedSampler (for set_epoch) but ported its loader as
    ft.DataLoader(shuffle=False): before the port it trained shuffled. Said once per worker; the
    run goes on with what the script asked for. Rank 0 says it: every worker builds the same loader."""
    script = _script(tmp_path, """
        sampler = DistributedSampler(full)
        loader = ft.DataLoader(full, batch_size=4, shuffle=False)
        train(loader)
    """)
    proc = run_ftrun(["--nproc", 2, "--ft", script], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "shuffle" in line and "DistributedSampler" in line]
    assert len(lines) == 1 and "shuffle=False" in lines[0] and "sampler=" in lines[0], lines


def test_a_set_epoch_counting_from_one_is_said_once_with_the_seed(ftrun_home, tmp_path):
    """minGPT's set_epoch(1..N) on the sampler it gave ft.DataLoader: ft.epochs() counts from 0, so
    the order is not the one the script trained; said once (by rank 0), naming seed=1."""
    script = _script(tmp_path, """
        loader = ft.DataLoader(full, batch_size=4, shuffle=False, sampler=DistributedSampler(full))
        for epoch in ft.epochs(3):
            loader.sampler.set_epoch(epoch + 1)
            for (x,) in loader:
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
    """)
    proc = run_ftrun(["--nproc", 2, "--ft", script], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "set_epoch(1)" in line]
    assert len(lines) == 1 and "pass seed=1" in lines[0], proc.stderr[-3000:]
    assert "set_epoch(2)" not in proc.stderr, proc.stderr[-3000:]


def test_the_scripts_distributed_sampler_sets_the_order(ftrun_home, tmp_path):
    """ft.DataLoader(ds, shuffle=False, sampler=DistributedSampler(ds, seed=1, drop_last=True)):
    the port of torch's common form is one word. The order is the sampler's (shuffled, seed 1:
    what a DistributedSampler gives at set_epoch(0), split over the live replicas), with no line
    about shuffle (shuffle=False is what torch's DataLoader requires beside a sampler)."""
    out = tmp_path / "o"
    script = _script(tmp_path, f"""
        train_set = Subset(full, range(62))
        loader = ft.DataLoader(train_set, batch_size=4, shuffle=False,
                               sampler=DistributedSampler(train_set, seed=1, drop_last=True))
        train(loader, epochs=2, out={str(out)!r})
    """)
    proc = run_ftrun(["--nproc", 2, "--ft", script], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shuffle" not in proc.stderr, proc.stderr[-3000:]
    import torch

    for rank in range(2):
        seen = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        for epoch in range(2):
            g = torch.Generator()
            g.manual_seed(1 + epoch)
            order = torch.randperm(62, generator=g).tolist()
            mine = [s for b in seen if b[0] == epoch for s in b[1:]]
            # 7 full steps of 8 samples; drop_last leaves the 6 that do not fill a step out
            assert mine == [i for k in range(7) for i in order[k * 8 + rank:k * 8 + 8:2]], (rank, epoch, mine)


def test_an_eval_loaders_distributed_sampler_works_on_a_restarted_replica(ftrun_home, tmp_path):
    """DistributedSampler(dataset) with no default group (the script never called
    init_process_group(), or a restarted replica, where ftrun skips the call): it splits over
    WORLD_SIZE at RANK, as the default group would, on every replica. Replica 1 is killed and
    comes back; its evaluation after training uses the sampler too."""
    out = tmp_path / "e"
    script = _script(tmp_path, f"""
        eval_loader = DataLoader(full, batch_size=8, sampler=DistributedSampler(full, shuffle=False))
        train(ft.DataLoader(full, batch_size=2, shuffle=True), epochs=3, sleep=0.02)
        mine = [int(v) for (x,) in eval_loader for v in x.flatten()]
        with open(f"{str(out)}.eval{{os.environ['RANK']}}.json", "w") as f:
            json.dump({{"mine": mine, "restarts": os.environ.get("TORCHELASTIC_RESTART_COUNT")}}, f)
    """)
    rc, err = _run_killing(ftrun_home, ["--nproc", 2, "--ft", "--run-id", "evs", script], "evs", 1, 1)
    assert rc == 0, err[-3000:]
    assert "restarting it alone" in err and "Traceback" not in err, err[-3000:]
    for rank in range(2):
        got = json.loads(Path(f"{out}.eval{rank}.json").read_text())
        assert got["mine"] == list(range(rank, 64, 2)), got
