"""A worker's end, as its other processes and its console see it (ftrun.worker.bootstrap): a
process it forks from its main thread (a DataLoader's workers) dies with it, and a collective that
failed because a peer went away leaves its traceback in the rank's log only. Real CLI, real
DataLoader workers."""

from __future__ import annotations

import json

from conftest import run_ftrun

# A DataLoader's worker says its parent-death signal (prctl PR_GET_PDEATHSIG) for a loader
# iterated in the main thread and for one iterated in another thread.
CHILDREN = """\
import ctypes, json, sys, threading
import torch
from torch.utils.data import DataLoader

def death_signal(_):
    sig = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
    return torch.tensor(sig.value)

def first(out, key):
    out[key] = int(next(iter(DataLoader(range(2), num_workers=1, collate_fn=death_signal))))

out = {}
first(out, "main")
t = threading.Thread(target=first, args=(out, "thread"))
t.start()
t.join()
json.dump(out, open(sys.argv[1], "w"))
"""


def test_a_loader_worker_dies_with_the_worker_that_forked_it(ftrun_home, tmp_path):
    """A loader worker that outlived its worker noticed a moment later that it was gone (a
    connection its dead parent reset) and printed a traceback: forked from the worker's main
    thread it has SIGKILL as its parent-death signal; forked from another thread none (the signal
    follows the thread that forked, and that thread may end while the worker trains on)."""
    script, out = tmp_path / "children.py", tmp_path / "signals.json"
    script.write_text(CHILDREN)
    proc = run_ftrun(["--nproc", 1, script, out], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == {"main": 9, "thread": 0}


def test_which_failures_are_a_peer_gone():
    """The failures whose traceback goes to the log only: torch's collectives (gloo's transport, a
    DistError) failing because the process at the other end went away, and a chain made only of
    them. A script's own error, even one raised while handling such a failure, a timeout, and a
    connection error of the script's own are printed as python prints them."""
    import torch.distributed as dist

    from ftrun.worker.bootstrap import _peer_lost

    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"
    closed = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2"

    def chained(outer: BaseException, inner: BaseException) -> BaseException:
        try:
            try:
                raise inner
            except BaseException:
                raise outer
        except BaseException as e:
            return e

    assert _peer_lost(RuntimeError(gloo)) and _peer_lost(dist.DistNetworkError("failed to recv, got 0 bytes"))
    assert _peer_lost(chained(RuntimeError(closed), RuntimeError(gloo)))  # Lightning's SIGTERM broadcast
    assert not _peer_lost(chained(ValueError("bad batch shape"), RuntimeError(gloo)))
    assert not _peer_lost(chained(RuntimeError(gloo), ValueError("bad batch shape")))
    assert not _peer_lost(RuntimeError("[../gloo/transport/tcp/pair.cc:1] Timed out waiting 1000ms for recv"))
    assert not _peer_lost(ConnectionResetError("Connection reset by peer"))
    assert not _peer_lost(RuntimeError("Connection reset by peer"))  # not torch's
