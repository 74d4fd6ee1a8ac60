"""--metrics-port: a daemon (in process, 127.0.0.1) and `peer train`'s loop (in a thread) export Prometheus
metrics; both scrapes parse with prometheus_client's parser and hold the named counters with plausible values."""

from __future__ import annotations

import functools
import math
import urllib.request

import trio
from prometheus_client.parser import text_string_to_metric_families

from peer.daemon import Daemon, DaemonConfig
from peer.p2p.addresses import pick_free_port
from peer.train import build_parser, run_training


def scrape(host: str, port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_daemon_and_trainer_metrics_after_some_training():
    async with trio.open_nursery() as nursery:
        daemon = Daemon(DaemonConfig(host="127.0.0.1", experts="ffn.[0:4]", hidden_dim=16, metrics_port=0, threads=1))
        info = await nursery.start(daemon.run)
        assert info.metrics_address is not None and info.metrics_address[0] == "127.0.0.1"
        trainer_port = pick_free_port("127.0.0.1")
        args = build_parser().parse_args([
            "--initial-peers", f"{info.address[0]}:{info.address[1]}", "--steps", "30", "--log-every", "10",
            "--batch-size", "16", "--k-best", "2", "--metrics-port", str(trainer_port)])
        scraped = {}

        def on_progress(line: dict) -> None:  # in the training thread, while the trainer's endpoint is up
            if line["step"] >= 20 and "trainer" not in scraped:
                scraped["trainer"] = scrape("127.0.0.1", trainer_port)

        await trio.to_thread.run_sync(functools.partial(run_training, args, on_progress))
        daemon_metrics = await trio.to_thread.run_sync(scrape, *info.metrics_address)
        nursery.cancel_scope.cancel()

    d = daemon_metrics
    assert value(d, "swarmd_rpc_calls_served_total") >= 40  # 20+ steps: a forward and a backward each
    assert value(d, "swarmd_rpc_served_seconds_count", method="moe.forward_batch", outcome="answered") >= 20
    assert 0 < value(d, "swarmd_rpc_served_seconds_sum", method="moe.forward_batch", outcome="answered") < 60
    assert value(d, "swarmd_rpc_bytes_received_total") > 1000 and value(d, "swarmd_rpc_bytes_sent_total") > 1000
    assert value(d, "swarmd_rpc_connections_total", direction="accepted") >= 1
    assert value(d, "swarmd_expert_requests_total", kind="forward") >= 20
    assert 0 < value(d, "swarmd_expert_batches_total") <= value(d, "swarmd_expert_samples_total")
    assert value(d, "swarmd_experts_served") == 4
    assert value(d, "swarmd_dht_routing_table_size") >= 0
    assert value(d, "swarmd_dht_requests_served_total", method="store") >= 1  # the trainer's progress records
    assert value(d, "swarmd_dht_operation_seconds_count", operation="store") >= 1

    t = scraped["trainer"]
    assert 0 < value(t, "swarmd_training_loss") < 10 and math.isfinite(value(t, "swarmd_training_loss"))
    assert value(t, "swarmd_training_samples_per_second") > 0
    assert value(t, "swarmd_training_steps_total") >= 20
    assert value(t, "swarmd_expert_calls_total", kind="forward", outcome="succeeded") >= 20
    assert value(t, "swarmd_rpc_calls_sent_total") >= 40
    assert value(t, "swarmd_averaging_rounds_total", kind="training", outcome="failed") >= 0
    assert value(t, "swarmd_dht_operation_seconds_count", operation="get") >= 1
    assert value(t, "swarmd_dht_routing_table_size") >= 1


def test_metrics_are_off_by_default():
    from peer.options import JOIN, TRAIN

    assert JOIN["metrics-port"].default is None and TRAIN["metrics-port"].default is None
    assert DaemonConfig().metrics_port is None
