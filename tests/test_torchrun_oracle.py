"""torchrun is the oracle: real-world torchrun command lines run under torchrun and under ftrun
(the word replaced), and every worker gets the same ranks, sizes, role, addresses and argv.

The workers are tiny scripts that dump their environment and argv as JSON and exit
(no torch import), so the table stays cheap. Nothing is forced on either side: no
--master-addr, no --rdzv-id, no environment tweak beyond what the shape itself says.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import free_port

BIN = Path(sys.executable).parent
FTRUN = str(BIN / "ftrun")  # the console script, as users run it (its sys.path[0] is .venv/bin, not the cwd)
TORCHRUN = str(BIN / "torchrun")

# Compared exactly in every shape.
EXACT = ("RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_NAME ROLE_RANK "
         "ROLE_WORLD_SIZE MASTER_ADDR TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS "
         "TORCHELASTIC_USE_AGENT_STORE TORCHELASTIC_SIGNALS_TO_HANDLE TORCH_NCCL_ASYNC_ERROR_HANDLING "
         "OMP_NUM_THREADS CUDA_VISIBLE_DEVICES").split()
# Compared exactly where torchrun's value is fixed by the command line, else by shape (free ports, uuids).
SHAPED = ("MASTER_PORT", "TORCHELASTIC_RUN_ID")

DUMP = """\
import json, os, sys
keys = {keys!r}
d = {{k: os.environ.get(k) for k in keys}}
d["argv"] = sys.argv
with open(os.path.join(os.environ["DUMP_DIR"], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(d, f)
"""

# (id, torchrun arguments after the launcher's name, source). {port} is a free port, {script} the dump
# script, {exe} an executable dump script, {abs} the dump script's absolute path. Lines are cut down to
# what this machine has (2 CPUs, no GPU): nproc 2 for 8, cpu for gpu; everything else as published.
SHAPES = [
    ("nanogpt-standalone", "--standalone --nproc_per_node=2 {script} config/train_gpt2.py",
     "karpathy/nanoGPT README: torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py"),
    ("torchtitan-example", "--standalone --nproc-per-node 2 {script}",
     "pytorch/examples run_example.sh: torchrun --standalone --nproc-per-node ${NGPU} train.py"),
    ("torchtitan-run-train", "--nproc_per_node=2 --rdzv_backend c10d --rdzv_endpoint=localhost:0 "
     "--local-ranks-filter 0 --role rank --tee 3 -m pkg.train --job.config_file ./train_configs/debug.toml",
     "pytorch/torchtitan run_train.sh: --rdzv_backend c10d --rdzv_endpoint=localhost:0 --local-ranks-filter "
     "${LOG_RANK} --role rank --tee 3 -m ${TRAIN_FILE} --job.config_file ${CONFIG_FILE}"),
    ("isc-demos-c10d-one-node", "--nnodes=1 --nproc_per_node=2 --rdzv_id=100 --rdzv_backend=c10d "
     "--rdzv_endpoint=localhost:{port} {script} --lr 0.1",
     "StrongResearch/isc-demos tiny_training/run.sh"),
    ("standalone-cpu", "--standalone --nproc_per_node=cpu --nnodes=1 {script}",
     "scout-op/CDVG VisTA run.sh (--nproc_per_node=gpu there; cpu is torchrun's word for this machine)"),
    ("hf-transformers-example", "--nproc_per_node 2 {script} --model_name_or_path bert-base-cased "
     "--task_name mrpc --do_train --output_dir /tmp/mrpc",
     "huggingface/transformers examples/pytorch README: torchrun --nproc_per_node 8 run_glue.py ..."),
    ("lightning-static", "--nproc_per_node=2 --nnodes=1 --node_rank 0 --master_addr localhost "
     "--master_port {port} {script}",
     "Lightning docs (clusters, torchrun): --nproc_per_node --nnodes --node_rank --master_addr --master_port"),
    ("pytorch-ddp-tutorial", "--nproc_per_node=2 --nnodes=1 --node_rank=0 --rdzv_id=456 --rdzv_backend=c10d "
     "--rdzv_endpoint=127.0.0.1:{port} {script} 50 10",
     "pytorch/examples distributed/ddp-tutorial-series: multinode.py 50 10 under torchrun --rdzv_id=456"),
    ("elastic-quickstart", "--nnodes=1:1 --nproc_per_node=2 --max_restarts=3 --rdzv_id=job7 "
     "--rdzv_backend=c10d --rdzv_endpoint=localhost:{port} {script}",
     "torch docs, elastic/quickstart: --nnodes=MIN_SIZE:MAX_SIZE --max_restarts --rdzv_id --rdzv_backend=c10d"),
    ("master-port-only", "--nproc_per_node=2 --master_port={port} {script} --data-path /data",
     "facebookresearch/deit README: torchrun --nproc_per_node=4 --master_port=... main.py --data-path"),
    ("dash-dash", "--nproc-per-node 2 -- {script} -- --after",
     "argparse's --: torchrun ... -- train.py (arguments that look like options stay the script's)"),
    ("dash-dash-after-module", "--standalone --nproc_per_node=2 -m pkg.train -- --depth=26",
     "issue 18: a -- after the module ends torchrun's options; the script gets ['--depth=26']"),
    ("dash-dash-after-script", "--nproc-per-node 2 {script} -- -- --x",
     "argparse's --: the first -- after the script is torchrun's, a second one is the script's"),
    ("no-python", "--nproc-per-node 2 --no-python {exe} --flag",
     "torch docs, torchrun --no-python: run an executable that is not a python script"),
    ("per-rank-tee", "--nproc-per-node 2 --tee 0:3,1:1 --redirects 1:2 --log-dir {logdir} {script}",
     "torch docs, torchrun --tee/--redirects: per-rank forms such as 0:3,1:1"),
    ("short-tee-redirects", "--nproc_per_node=2 -t 3 -r 3 --log_dir={logdir} {script}",
     "torch docs: -r 3 redirects both streams of every worker, -t tees"),
    ("role-and-restarts", "--nproc-per-node 3 --role trainer --max-restarts 2 {script}",
     "torch docs: --role, --max-restarts"),
    ("monitor-and-start-method", "--nproc_per_node=2 --monitor_interval=1 --start_method=fork "
     "--local_ranks_filter=0,1 {script}", "torch docs: --monitor-interval, --start-method, --local-ranks-filter"),
    ("run-path", "--nproc-per-node 2 --run-path {abs} --x 1", "torch docs: --run-path /abs/path/script.py"),
    ("rdzv-conf", "--nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=localhost:0 "
     "--rdzv-conf=join_timeout=60,read_timeout=60,close_timeout=10 {script}",
     "torch docs, elastic/run: --rdzv-conf key=value pairs (join_timeout, read_timeout, close_timeout)"),
    ("signals-shutdown-virtual", "--nproc-per-node 2 --signals-to-handle SIGTERM,SIGUSR1 --shutdown-timeout 10 "
     "--virtual-local-rank {script}",
     "torch docs: --signals-to-handle (SIGUSR1 under Slurm), --shutdown-timeout, --virtual-local-rank"),
    ("python-m-launcher", "PYTHON-M --standalone --nproc-per-node 2 {script}",
     "pytorch/examples run_example.sh: python -m torch.distributed.run --standalone --nproc-per-node ${NGPU}"),
    ("kubeflow-pet", "PET {script} --epochs 1",
     "Kubeflow PyTorchJob: the pod runs torchrun train.py with PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, "
     "PET_MASTER_ADDR, PET_MASTER_PORT set, and RANK/WORLD_SIZE/MASTER_* of the pod itself"),
]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project root with the dump script as a file, a package module and an executable."""
    d = tmp_path_factory.mktemp("proj")
    text = DUMP.format(keys=EXACT + list(SHAPED))
    (d / "train.py").write_text(text)
    (d / "pkg").mkdir()
    (d / "pkg" / "__init__.py").write_text("")
    (d / "pkg" / "train.py").write_text(text)
    exe = d / "dump_exe"
    exe.write_text(f"#!{sys.executable}\n" + text)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return d


def _start(launcher: str, shape: str, project: Path, out: Path, home: Path):
    port = free_port()
    logdir = out.parent / (out.name + "-logs")
    words = shape.format(script="train.py", exe="./dump_exe", abs=str(project / "train.py"), port=port,
                         logdir=logdir)
    argv = shlex.split(words)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "OMP_NUM", "TORCHELASTIC"))}
    env.update(DUMP_DIR=str(out), FTRUN_HOME=str(home))
    if argv[0] == "PYTHON-M":
        cmd = [sys.executable, "-m", "torch.distributed.run" if launcher == "torchrun" else "ftrun"] + argv[1:]
    elif argv[0] == "PET":
        pod = free_port()
        env.update(PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_NODE_RANK="0", PET_MASTER_ADDR="localhost",
                   PET_MASTER_PORT=str(port), RANK="3", WORLD_SIZE="8", MASTER_ADDR="pod-0",
                   MASTER_PORT=str(pod), LOCAL_RANK="5")
        cmd = [TORCHRUN if launcher == "torchrun" else FTRUN] + argv[1:]
    else:
        cmd = [TORCHRUN if launcher == "torchrun" else FTRUN] + argv
    out.mkdir(parents=True)
    proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, port, words


def _finish(launcher: str, started, out: Path):
    proc, port, words = started
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    assert proc.returncode == 0, f"{launcher} {words}: exit {proc.returncode}\n{stderr[-3000:]}"
    dumps = {int(f.stem): json.loads(f.read_text()) for f in out.glob("*.json")}
    return dumps, port


QUICK = ("dash-dash-after-module",)  # the quick tier's line: --standalone, -m, and a --
# Lines whose options another line of the CI suite's table spells too (c10d endpoints, static
# addresses, -- forms, --tee/--redirects, torchrun's other options): the extended tier's. Each line
# costs both launchers' start (about 6 CPU-s), and CI's 20 minutes hold the distinct shapes.
EXTENDED = ("torchtitan-example", "isc-demos-c10d-one-node", "pytorch-ddp-tutorial", "master-port-only",
            "dash-dash-after-script", "short-tee-redirects", "monitor-and-start-method", "run-path",
            "signals-shutdown-virtual")


def _tier(name: str):
    return pytest.mark.quick if name in QUICK else pytest.mark.extended if name in EXTENDED else ()


@pytest.mark.parametrize("name,shape,source", [pytest.param(*s, id=s[0], marks=_tier(s[0])) for s in SHAPES])
def test_same_as_torchrun(project, tmp_path, name, shape, source):
    # Both at once: the table is long, and neither launcher may depend on the other being idle.
    t = _start("torchrun", shape, project, tmp_path / "t", tmp_path / "home")
    f = _start("ftrun", shape, project, tmp_path / "f", tmp_path / "home")
    ours, fport = _finish("ftrun", f, tmp_path / "f")
    theirs, tport = _finish("torchrun", t, tmp_path / "t")
    assert theirs and sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
    for rank in theirs:
        t, f = theirs[rank], ours[rank]
        for k in EXACT:
            assert f[k] == t[k], (rank, k, f[k], t[k])
        assert f["argv"] == [a.replace(str(tport), str(fport)) for a in t["argv"]], (f["argv"], t["argv"])
        if t["MASTER_PORT"] == str(tport):
            assert f["MASTER_PORT"] == str(fport), ("MASTER_PORT", f["MASTER_PORT"], fport)
        else:
            assert f["MASTER_PORT"].isdigit(), f["MASTER_PORT"]
        uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
        if re.fullmatch(uuid, t["TORCHELASTIC_RUN_ID"]):
            assert re.fullmatch(uuid, f["TORCHELASTIC_RUN_ID"]), f["TORCHELASTIC_RUN_ID"]
        else:
            assert f["TORCHELASTIC_RUN_ID"] == t["TORCHELASTIC_RUN_ID"]


SHOUT = """\
import os, sys
print("out", os.environ["LOCAL_RANK"], flush=True)
print("err", os.environ["LOCAL_RANK"], file=sys.stderr, flush=True)
"""


def test_redirects_and_tee_per_rank(tmp_path):
    """-r 3 with --tee 0:3,1:1,3:3 and --local-ranks-filter 0,1,2: rank 0 shows both streams, rank 1 only
    stdout, rank 2 nothing (redirected), rank 3 nothing (filtered, teed or not); the files keep everything."""
    script = tmp_path / "shout.py"
    script.write_text(SHOUT)
    p = subprocess.run([FTRUN, "--nproc-per-node", "4", "-r", "3", "--tee", "0:3,1:1,3:3",
                        "--local-ranks-filter", "0,1,2", str(script)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=dict(os.environ, FTRUN_HOME=str(tmp_path / "home")))
    assert p.returncode == 0, p.stderr
    shown = {(stream, line.split()[-1]) for stream, text in (("out", p.stdout), ("err", p.stderr))
             for line in text.splitlines() if re.search(r"\] (out|err) \d$", line)}
    assert shown == {("out", "0"), ("err", "0"), ("out", "1")}, (p.stdout, p.stderr)
    logs = sorted((tmp_path / "home").rglob("stderr.log"))
    assert len(logs) == 4 and all("err" in f.read_text() for f in logs)  # the files have everything


def test_pgrep_finds_every_worker_by_script_name(tmp_path):
    """Workers are titled `ftrun[rank N] python SCRIPT ARGS`, so pgrep -f SCRIPT finds all of them."""
    script = tmp_path / "wait_here.py"
    marker = tmp_path / "go"
    script.write_text("import os, sys, time\nopen(sys.argv[1] + '.' + os.environ['RANK'], 'w').close()\n"
                      "deadline = time.time() + 60\n"
                      "while not os.path.exists(sys.argv[1]) and time.time() < deadline:\n    time.sleep(0.05)\n")
    proc = subprocess.Popen([FTRUN, "--nproc-per-node", "3", "--run-id", "titles", "wait_here.py", str(marker)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, FTRUN_HOME=str(tmp_path / "home")))
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("go.*"))) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        found = subprocess.run(["pgrep", "-f", "wait_here.py"], capture_output=True, text=True).stdout.split()
        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if c.cmdline()[:1] and c.cmdline()[0].startswith("ftrun[rank")]
        titles = sorted(" ".join(w.cmdline()).strip() for w in workers)  # the kernel may pad the title
        assert titles == [f"ftrun[rank {r}] python wait_here.py {marker}" for r in range(3)], titles
        assert {str(w.pid) for w in workers} <= set(found), (found, titles)
        zygotes = [c for c in psutil.Process(proc.pid).children() if "zygote" in " ".join(c.cmdline())]
        assert [" ".join(z.cmdline()).strip() for z in zygotes] == ["ftrun zygote titles"]
    finally:
        marker.touch()
        proc.wait(60)
    assert proc.returncode == 0
