"""--metrics-port: the supervisor's figures as Prometheus text, served by prometheus_client.

One collector reads the newest MetricsView (replaced whole by the supervisor's loop a
few times a second, so a scrape never sees half an update) and yields every metric
labelled with the run id and the node. The HTTP server is prometheus_client's own, on
its own daemon thread, bound to loopback unless the option names another address.
Must never import torch, block the supervisor's loop, or decide anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

HEAL_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FAILURE_KINDS = ("exit", "signal", "hang")


@dataclass(frozen=True)
class MetricsView:
    """What one scrape shows; built by ftrun.supervisor.accounting.ledger from the goodput books."""

    replicas: Dict[str, int] = field(default_factory=dict)      # lane state -> replicas in it
    steps_committed: int = 0
    steps_discarded: int = 0
    failures: Dict[str, int] = field(default_factory=dict)      # kind -> count
    restarts: int = 0
    heal_s: Tuple[float, ...] = ()                               # each failure's time until back
    goodput: Optional[float] = None
    lost_s: Dict[str, float] = field(default_factory=dict)      # cause -> replica-seconds
    spare_s: Optional[float] = None                              # --spares: hot spares' waiting replica-seconds
    checkpoint_s: Dict[str, float] = field(default_factory=dict)  # write / pause -> seconds, newest checkpoint


class RunCollector:
    """A prometheus_client collector over the newest view of one run on one node."""

    def __init__(self, run_id: str, node: int) -> None:
        self.labels = [run_id, str(node)]
        self.view = MetricsView()

    def update(self, view: MetricsView) -> None:
        self.view = view  # one reference swap: a scrape reads the old view or the new one, whole

    def collect(self) -> Iterator[Metric]:
        v, base = self.view, ["run_id", "node"]
        g = GaugeMetricFamily("ftrun_replicas", "Replicas of this node by state (starting, training, healing, "
                              "away, hung, done; spare: a hot spare waiting; gone: given up after its restarts).",
                              labels=base + ["state"])
        for state, n in sorted(v.replicas.items()):
            g.add_metric(self.labels + [state], n)
        yield g
        c = CounterMetricFamily("ftrun_steps_committed", "Steps the run took that count (once per step, not per "
                                "replica; without --ft, steps later lost to a group restart are counted here "
                                "and in ftrun_steps_discarded_total).", labels=base)
        c.add_metric(self.labels, v.steps_committed)
        yield c
        c = CounterMetricFamily("ftrun_steps_discarded", "Steps discarded or redone after failures.", labels=base)
        c.add_metric(self.labels, v.steps_discarded)
        yield c
        c = CounterMetricFamily("ftrun_failures", "Failures of this node's replicas by cause: exit (a non-zero "
                                "status), signal (killed by one), hang (found hung and killed).",
                                labels=base + ["cause"])
        for kind in sorted(set(FAILURE_KINDS) | set(v.failures)):
            c.add_metric(self.labels + [kind], v.failures.get(kind, 0))
        yield c
        c = CounterMetricFamily("ftrun_restarts", "Restarts: of a replica with --ft, of the group without.",
                                labels=base)
        c.add_metric(self.labels, v.restarts)
        yield c
        yield self._heal_histogram(v.heal_s)
        g = GaugeMetricFamily("ftrun_goodput_ratio", "Replica-time spent on committed steps over the run's "
                              "replica-time so far.", labels=base)
        if v.goodput is not None:
            g.add_metric(self.labels, v.goodput)
        yield g
        g = GaugeMetricFamily("ftrun_lost_seconds", "Replica-seconds not spent on committed steps, by cause.",
                              labels=base + ["cause"])
        for cause, s in sorted(v.lost_s.items()):
            g.add_metric(self.labels + [cause], s)
        yield g
        if v.spare_s is not None:
            g = GaugeMetricFamily("ftrun_spare_seconds", "--spares: replica-seconds spent as hot spares (their "
                                  "start-up until held back, and the wait), apart from the replica-time goodput "
                                  "is the share of.", labels=base)
            g.add_metric(self.labels, v.spare_s)
            yield g
        g = GaugeMetricFamily("ftrun_checkpoint_seconds", "The newest checkpoint: seconds to write it and seconds "
                              "the training loop paused for it.", labels=base + ["phase"])
        for phase, s in sorted(v.checkpoint_s.items()):
            g.add_metric(self.labels + [phase], s)
        yield g

    def _heal_histogram(self, values: Tuple[float, ...]) -> HistogramMetricFamily:
        h = HistogramMetricFamily("ftrun_heal_seconds", "Seconds from a failure until its replica (or the group) "
                                  "trained again.", labels=["run_id", "node"])
        buckets: List[Tuple[str, float]] = [(repr(b), float(sum(1 for x in values if x <= b))) for b in HEAL_BUCKETS]
        buckets.append(("+Inf", float(len(values))))
        h.add_metric(self.labels, buckets, sum_value=float(sum(values)))
        return h


class MetricsServer:
    """The HTTP endpoint: GET /metrics on host:port (port 0: a free one, see .port)."""

    def __init__(self, host: str, port: int, run_id: str, node: int) -> None:
        self.collector = RunCollector(run_id, node)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self.server.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
