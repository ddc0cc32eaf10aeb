"""Prometheus ``/metrics`` for a service (opt-in: ``metrics_port``), with ``prometheus_client``.

Each service describes its figures as a function returning samples, read at scrape time from the state
the service keeps anyway: nothing is updated on the hot path for the sake of metrics, and a scrape never
waits on the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector


@dataclass(frozen=True)
class Sample:
    name: str  # without the fp8rl_ prefix; a counter's without _total
    kind: Literal["counter", "gauge", "summary"]
    help: str
    value: float
    total: float = 0.0  # summary: the sum of the observed values (value is their count)


class _Collector(Collector):
    def __init__(self, samples: Callable[[], list[Sample]]) -> None:
        self.samples = samples

    def collect(self) -> Iterator[Metric]:
        for s in self.samples():
            name = f"fp8rl_{s.name}"
            if s.kind == "counter":
                yield CounterMetricFamily(name, s.help, value=s.value)
            elif s.kind == "gauge":
                yield GaugeMetricFamily(name, s.help, value=s.value)
            else:
                yield SummaryMetricFamily(name, s.help, count_value=int(s.value), sum_value=s.total)


class MetricsServer:
    """``GET /metrics`` on ``host:port`` (0: a free port, in ``self.port``), on a thread of its own."""

    def __init__(self, host: str, port: int, samples: Callable[[], list[Sample]]) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(samples))
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = int(self._server.server_port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
