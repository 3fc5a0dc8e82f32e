"""--metrics-port: a real Prometheus server (Debian's package, scripts/setup_system.sh)
scrapes a live run, and its HTTP API returns the run's committed steps; the text
itself carries every metric, labelled with the run id and the node; a kill shows
in the failure, restart and heal metrics; the endpoint listens on loopback only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request

import psutil
import pytest

from conftest import FTRUN, ROOT, SCRIPTS, free_port, run_ftrun
from helpers import read_state, wait_for, wait_state

METRICS = ("ftrun_replicas", "ftrun_steps_committed_total", "ftrun_steps_discarded_total", "ftrun_failures_total",
           "ftrun_restarts_total", "ftrun_heal_seconds_bucket", "ftrun_heal_seconds_count", "ftrun_goodput_ratio",
           "ftrun_checkpoint_seconds", "ftrun_lost_seconds")


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _samples(text: str, name: str) -> dict:
    """{label text: value} of metric `name` in Prometheus text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            out[labels[len(name):]] = float(value)
    return out


def test_prometheus_scrapes_a_live_run(tmp_path):
    prom = shutil.which("prometheus")
    if prom is None:
        pytest.skip("prometheus is not installed (scripts/setup_system.sh installs Debian's package as root)")
    home, run_id = tmp_path / "home", "metrics-run"
    port, prom_port = free_port(), free_port()
    env = dict(os.environ, FTRUN_HOME=str(home))
    args = ["--nproc", 2, "--ft", "--run-id", run_id, "--metrics-port", port, SCRIPTS / "train_ft.py",
            "--steps", 100000, "--step-sleep", 0.01]
    proc = subprocess.Popen(FTRUN + [str(a) for a in args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    server = None
    try:
        st = wait_state(home, run_id, lambda s: (s.get("steps_committed") or 0) >= 5, 90, "the run's first steps", proc)
        assert st["metrics_url"] == f"http://127.0.0.1:{port}/metrics"
        text = _get(st["metrics_url"])
        for name in METRICS:
            assert name in text, f"{name} missing from\n{text}"
        labels = '{node="0",run_id="metrics-run"}'
        assert _samples(text, "ftrun_steps_committed_total")[labels] >= 5
        # Each replica's lane turns to training on its own progress report, which may come a
        # beat after the quorum's count of committed steps: read again until it has.
        training = '{node="0",run_id="metrics-run",state="training"}'
        wait_for(lambda: _samples(_get(st["metrics_url"]), "ftrun_replicas").get(training) == 2, 10,
                 "both replicas counted as training", proc, poll=0.1)
        # Productive time is a lane's time between two of its own steps: on a loaded machine the
        # lanes' second progress reports may come after the quorum's fifth commit.
        ratio = wait_for(lambda: (g := _samples(_get(st["metrics_url"]), "ftrun_goodput_ratio")[labels]) > 0 and g,
                         10, "a goodput ratio above 0", proc, poll=0.1)
        assert 0 < ratio <= 1
        # bound to loopback: the one listening socket on that port is 127.0.0.1's
        sup = psutil.Process(proc.pid)
        listeners = [c for c in getattr(sup, "net_connections", sup.connections)("inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert [c.laddr.ip for c in listeners] == ["127.0.0.1"], listeners

        # A real Prometheus scrapes it once a second; its API answers the run's committed steps.
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: ftrun\n"
                       f"    static_configs:\n      - targets: ['127.0.0.1:{port}']\n")
        server = subprocess.Popen([prom, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        query = urllib.parse.quote(f'ftrun_steps_committed_total{{run_id="{run_id}"}}')

        def answered():
            try:
                body = json.loads(_get(f"http://127.0.0.1:{prom_port}/api/v1/query?query={query}"))
            except (OSError, ValueError):
                return None
            result = body.get("data", {}).get("result", [])
            return result if result and float(result[0]["value"][1]) >= 5 else None

        (sample,) = wait_for(answered, 60, "Prometheus's answer", [proc, server], poll=0.1)
        assert sample["metric"]["run_id"] == run_id and sample["metric"]["node"] == "0"
        assert sample["metric"]["job"] == "ftrun"

        # `ftrun status --json` shows the live goodput too.
        live = json.loads(run_ftrun(["status", run_id, "--json"], env={"FTRUN_HOME": str(home)}, check=True).stdout)
        assert 0 < live[0]["goodput"] <= 1 and live[0]["lost_s"]["startup"] > 0
        table = run_ftrun(["status", run_id], env={"FTRUN_HOME": str(home), "COLUMNS": "200"}, check=True).stdout
        assert re.search(r"goodput [\d.]+%; lost: start-up ", table), table

        # A kill: counted by cause, restarted, and its time until back in the heal histogram.
        victim = next(r for r in read_state(home, run_id)["replicas"] if r["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        wait_state(home, run_id, lambda s: s["failures"] and s["failures"][0]["back_s"] is not None, 90,
                   "the replica back", proc)
        text = _get(st["metrics_url"])
        assert _samples(text, "ftrun_failures_total")['{cause="signal",node="0",run_id="metrics-run"}'] == 1
        assert _samples(text, "ftrun_restarts_total")[labels] == 1
        assert _samples(text, "ftrun_heal_seconds_count")[labels] == 1
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        finally:
            proc.kill()
    assert proc.returncode == 130


def test_metrics_port_in_use_is_one_line_and_nothing_starts(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_ftrun(["--metrics-port", port, str(SCRIPTS / "train_ft.py")],
                         env={"FTRUN_HOME": str(tmp_path / "home")})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and f"--metrics-port 127.0.0.1:{port}: the port is already in use" in proc.stderr
    assert not (tmp_path / "home").exists() or not list((tmp_path / "home").glob("*/state.json"))


@pytest.mark.quick
@pytest.mark.parametrize("args, env, problem", [
    (["--metrics-port", "abc"], {}, "--metrics-port must be a port (served on 127.0.0.1) or HOST:PORT such as 0.0.0.0:9400, not 'abc'"),
    ([], {"PET_METRICS_PORT": "70000"}, "PET_METRICS_PORT='70000' must be a port"),
    (["--metrics-port", "203.0.113.9:9400"], {}, "203.0.113.9 is not an address of this machine"),
])
def test_bad_metrics_port_is_one_line(tmp_path, args, env, problem):
    proc = run_ftrun(args + [str(SCRIPTS / "train_ft.py")], env={"FTRUN_HOME": str(tmp_path / "h"), **env})
    assert proc.returncode == 2, proc.stderr
    assert problem in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.quick
def test_hot_spares_show_apart_in_the_metrics():
    """--spares: a waiting spare is its own replica state (a replica given up is `gone`), and the
    spares' waiting replica-seconds are a gauge of their own, apart from the lost seconds; a run
    without spares has no such gauge."""
    from prometheus_client import CollectorRegistry, generate_latest

    from ftrun.supervisor.accounting.metrics import MetricsView, RunCollector

    def text(view: MetricsView) -> str:
        c, reg = RunCollector("r", 0), CollectorRegistry()
        c.update(view)
        reg.register(c)
        return generate_latest(reg).decode()

    got = text(MetricsView(replicas={"training": 3, "spare": 1, "gone": 0}, goodput=0.9, lost_s={"startup": 2.0},
                           spare_s=5.5))
    assert 'ftrun_replicas{node="0",run_id="r",state="spare"} 1.0' in got, got
    assert 'ftrun_replicas{node="0",run_id="r",state="gone"} 0.0' in got, got
    assert 'ftrun_spare_seconds{node="0",run_id="r"} 5.5' in got, got
    assert "ftrun_spare_seconds" not in text(MetricsView(replicas={"training": 3}))
