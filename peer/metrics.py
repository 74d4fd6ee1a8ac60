"""Prometheus metrics for daemons and trainers (`--metrics-port`): one collector that reads the counters the peer
already keeps, at scrape time.

Why a collector over the existing `stats()` instead of metric objects updated in the code paths: every layer
already counts what `peer status` shows (RPC calls, DHT requests and table, expert requests and batches, averaging
rounds), so reading those when Prometheus scrapes costs nothing between scrapes and cannot drift from what
`peer status` reports. Only what no counter holds is observed as it happens: the latency of each served RPC by
method (the RPC node's `on_served` hook) and of the DHT operations this peer starts (`time_dht_operations`).
An expert's compute time is the served latency of its forward and backward methods. The text format is
prometheus_client's (`generate_latest`); the endpoint is served by Hypercorn in the peer's own trio loop
(peer/dashboard/http.py), so stats are read between the peer's tasks, never from another thread.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Awaitable, Callable, Iterator

import trio
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

Source = Callable[[], "dict[str, Any] | None"]
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# the two traversals every DHT read and write goes through (get and store call them), by the label they get
DHT_OPERATIONS = {"get_many": "get", "store_many": "store"}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class SwarmCollector(Collector):
    """Metric families from the peer's stats sources, read at every scrape. Each source is a callable returning
    that component's `stats()` dict, or None while the component is not running (its metrics are then absent)."""

    def __init__(self, *, rpc: Source | None = None, dht: Source | None = None, experts: Source | None = None,
                 expert_client: Source | None = None, averaging: Source | None = None,
                 replicas: Source | None = None, training: Source | None = None):
        self.sources = {"rpc": rpc, "dht": dht, "experts": experts, "expert_client": expert_client,
                        "averaging": averaging, "replicas": replicas, "training": training}

    def _read(self, name: str) -> dict[str, Any] | None:
        source = self.sources[name]
        return source() if source is not None else None

    def collect(self) -> Iterator[Metric]:
        yield from self._rpc(self._read("rpc"))
        yield from self._dht(self._read("dht"))
        yield from self._experts(self._read("experts"))
        yield from self._expert_client(self._read("expert_client"))
        yield from self._averaging(self._read("averaging"), self._read("replicas"))
        yield from self._training(self._read("training"))

    @staticmethod
    def _counter(name: str, help_text: str, value: Any) -> Iterator[Metric]:
        number = _number(value)
        if number is not None:
            yield CounterMetricFamily(name, help_text, value=number)

    @staticmethod
    def _gauge(name: str, help_text: str, value: Any) -> Iterator[Metric]:
        number = _number(value)
        if number is not None:
            yield GaugeMetricFamily(name, help_text, value=number)

    @staticmethod
    def _labelled(family: CounterMetricFamily | GaugeMetricFamily, values: dict[str, Any]) -> Iterator[Metric]:
        for label, value in sorted(values.items()):
            number = _number(value)
            if number is not None:
                family.add_metric([str(label)], number)
        yield family

    def _rpc(self, stats: dict[str, Any] | None) -> Iterator[Metric]:
        if stats is None:
            return
        c = self._counter
        yield from c("swarmd_rpc_calls_sent", "RPC calls this peer made", stats.get("calls_sent"))
        yield from c("swarmd_rpc_calls_failed", "RPC calls this peer made that failed", stats.get("calls_failed"))
        yield from c("swarmd_rpc_calls_received", "RPC calls other peers made to this one",
                     stats.get("calls_received"))
        yield from c("swarmd_rpc_calls_served", "RPC calls this peer answered", stats.get("calls_served"))
        yield from c("swarmd_rpc_bytes_sent", "bytes written to RPC connections", stats.get("bytes_sent"))
        yield from c("swarmd_rpc_bytes_received", "bytes read from RPC connections", stats.get("bytes_received"))
        connections = CounterMetricFamily("swarmd_rpc_connections", "RPC connections by direction",
                                          labels=["direction"])
        yield from self._labelled(connections, {"opened": stats.get("connections_opened"),
                                                "accepted": stats.get("connections_accepted")})
        errors = CounterMetricFamily("swarmd_rpc_errors", "failed or refused RPC traffic by kind", labels=["kind"])
        yield from self._labelled(errors, {key: stats.get(key) for key in (
            "error_replies", "handler_errors", "handler_failures", "handlers_cancelled", "handshake_failures",
            "protocol_errors", "rejected_messages")})

    def _dht(self, stats: dict[str, Any] | None) -> Iterator[Metric]:
        if stats is None:
            return
        yield from self._gauge("swarmd_dht_routing_table_size", "contacts in the DHT routing table",
                               stats.get("routing_table_size"))
        yield from self._gauge("swarmd_dht_records_held", "DHT records this node stores", stats.get("records_held"))
        yield from self._gauge("swarmd_dht_peers_known", "peers the DHT node has heard of", stats.get("peers_known"))
        served = CounterMetricFamily("swarmd_dht_requests_served", "DHT requests answered, by method",
                                     labels=["method"])
        yield from self._labelled(served, stats.get("requests_served") or {})
        dropped = CounterMetricFamily("swarmd_dht_datagrams_dropped", "DHT datagrams ignored, by reason",
                                      labels=["reason"])
        yield from self._labelled(dropped, stats.get("dropped") or {})
        yield from self._counter("swarmd_dht_rebootstraps", "times the DHT node rejoined through known peers",
                                 stats.get("rebootstraps"))

    def _experts(self, stats: dict[str, Any] | None) -> Iterator[Metric]:
        if stats is None:
            return
        requests = CounterMetricFamily("swarmd_expert_requests", "expert requests served, by kind",
                                       labels=["kind"])
        yield from self._labelled(requests, stats.get("requests") or {})
        yield from self._counter("swarmd_expert_batches", "batches the expert runtime computed (mean batch size: "
                                 "samples / batches)", stats.get("batches"))
        yield from self._counter("swarmd_expert_samples", "samples the expert runtime computed",
                                 stats.get("samples"))
        errors = CounterMetricFamily("swarmd_expert_errors", "expert requests that failed, by reason",
                                     labels=["reason"])
        yield from self._labelled(errors, stats.get("errors") or {})
        per_expert = stats.get("per_expert") or {}
        by_uid = CounterMetricFamily("swarmd_expert_uid_requests", "requests served per expert", labels=["uid"])
        yield from self._labelled(by_uid, {uid: sum((entry.get("requests") or {}).values())
                                           for uid, entry in per_expert.items()})
        yield from self._gauge("swarmd_experts_served", "experts this peer serves", len(stats.get("experts") or ()))

    def _expert_client(self, stats: dict[str, Any] | None) -> Iterator[Metric]:
        if stats is None:
            return
        calls = CounterMetricFamily("swarmd_expert_calls", "expert calls this trainer made, by kind and outcome",
                                    labels=["kind", "outcome"])
        for kind in ("forward", "backward"):
            total, failed = _number(stats.get(f"{kind}_calls")), _number(stats.get(f"{kind}_failures"))
            if total is not None and failed is not None:
                calls.add_metric([kind, "failed"], failed)
                calls.add_metric([kind, "succeeded"], max(0.0, total - failed))
        yield calls

    def _averaging(self, trainer: dict[str, Any] | None, replicas: dict[str, Any] | None) -> Iterator[Metric]:
        rounds = CounterMetricFamily("swarmd_averaging_rounds", "averaging rounds by outcome",
                                     labels=["kind", "outcome"])
        if trainer is not None:
            succeeded = _number(trainer.get("averaging_rounds")) or 0.0
            rounds.add_metric(["training", "succeeded"], succeeded)
            rounds.add_metric(["training", "failed"], _number(trainer.get("averaging_failures")) or 0.0)
        if replicas is not None:
            rounds.add_metric(["replicas", "succeeded"], _number(replicas.get("rounds")) or 0.0)
            rounds.add_metric(["replicas", "failed"], _number(replicas.get("failures")) or 0.0)
        if trainer is None and replicas is None:
            return
        yield rounds
        if trainer is not None:
            yield from self._counter("swarmd_averaging_seconds", "seconds spent in averaging rounds",
                                     trainer.get("averaging_seconds"))
            sizes = CounterMetricFamily("swarmd_averaging_groups", "averaging rounds by group size", labels=["size"])
            yield from self._labelled(sizes, trainer.get("group_sizes") or {})
            yield from self._gauge("swarmd_training_epoch", "collective epoch of this trainer", trainer.get("epoch"))

    def _training(self, stats: dict[str, Any] | None) -> Iterator[Metric]:
        if stats is None:
            return
        yield from self._gauge("swarmd_training_loss", "training loss (moving average, at the last progress line)",
                               stats.get("loss"))
        yield from self._gauge("swarmd_training_accuracy", "training accuracy (moving average)",
                               stats.get("accuracy"))
        yield from self._gauge("swarmd_training_samples_per_second", "this trainer's throughput",
                               stats.get("samples_per_s"))
        yield from self._counter("swarmd_training_steps", "local training steps done", stats.get("step"))
        yield from self._counter("swarmd_training_samples", "samples trained on", stats.get("samples"))


class PeerMetrics:
    """One peer's registry: the scrape-time collector plus the two latency histograms fed as things happen."""

    def __init__(self, collector: SwarmCollector):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.rpc_served = Histogram("swarmd_rpc_served_seconds", "time to answer an RPC call, by method and outcome",
                                    ["method", "outcome"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self.dht_operations = Histogram("swarmd_dht_operation_seconds", "DHT operations this peer started, by "
                                        "operation", ["operation"], registry=self.registry, buckets=LATENCY_BUCKETS)

    def observe_served(self, method: str, seconds: float, answered: bool) -> None:
        """The RPC node's `on_served` hook."""
        self.rpc_served.labels(method, "answered" if answered else "abandoned").observe(seconds)

    def time_dht_operations(self, dht: Any) -> None:
        """Time this node's DHT reads and writes by wrapping its two traversals on the instance: the DHT layer
        stays free of metrics code, and everything of the app that uses this node is timed."""
        for name, label in DHT_OPERATIONS.items():
            method = getattr(dht, name, None)
            if method is not None:
                setattr(dht, name, self._timed(label, method))

    def _timed(self, name: str, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        histogram = self.dht_operations.labels(name)

        @functools.wraps(method)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await method(*args, **kwargs)
            finally:
                histogram.observe(time.perf_counter() - started)

        return timed

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def app(self) -> Any:
        """A Starlette app answering GET /metrics (anything else: 404)."""
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        async def metrics(request: Request) -> Response:
            return Response(self.render(), media_type=CONTENT_TYPE)

        return Starlette(routes=[Route("/metrics", metrics)])

    async def serve(self, host: str, port: int, *,
                    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve /metrics on host:port until cancelled; `started` with the bound address."""
        from peer.dashboard.http import serve_asgi

        await serve_asgi(self.app(), host, port, name="metrics", task_status=task_status)


def peer_metrics(rpc: Any, dht: Any, **sources: Source | None) -> PeerMetrics:
    """Metrics for a peer made of `rpc` (an RPCNode) and `dht` (a DHTNode) plus the other sources; installs the
    served-latency hook on `rpc` and times `dht`'s operations."""
    metrics = PeerMetrics(SwarmCollector(rpc=lambda: dict(rpc.stats), dht=dht.stats, **sources))
    rpc.on_served = metrics.observe_served
    metrics.time_dht_operations(dht)
    return metrics
