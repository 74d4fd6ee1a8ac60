"""Volunteers serve what models need: swarmify advertises its expert spec in the DHT, a plain `peer join
--initial-peers X` serves free uids of it (never a layer beyond), the `peer join` line SwarmNotServing prints works
on several daemons, and `peer status` shows the experts' kinds. Daemons and the trainer are separate peers on
127.0.0.1 sockets."""

from __future__ import annotations

import shlex

import pytest
import torch
import trio
from torch import nn

from moe.specs import read_specs
from moe.swarmify import SwarmNotServing, swarmify
from peer.cli import build_parser, join_options
from peer.client import Swarm
from peer.daemon import Daemon, DaemonConfig, DaemonInfo
from peer.p2p.bridge import Bridge
from peer.status import format_status, gather_status

HIDDEN = 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(HIDDEN, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))


def _start(bridge: Bridge, config: DaemonConfig) -> DaemonInfo:
    daemon = Daemon(config)

    async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
        await daemon.run(task_status=task_status)

    return bridge.start_and_wait(run)


def _bootstrap(bridge: Bridge) -> str:
    """A daemon of another family (what a swarm already has), whose address everyone joins through."""
    info = _start(bridge, DaemonConfig(host="127.0.0.1", experts="other.[0:2]", expert_kind="ffn", hidden_dim=8))
    return f"{info.address[0]}:{info.address[1]}"


def test_a_plain_join_serves_the_advertised_spec_and_no_layer_beyond_it():
    with Bridge.start() as bridge:
        bootstrap = _bootstrap(bridge)
        with Swarm([bootstrap]) as swarm:
            model = _model()
            with pytest.raises(SwarmNotServing):
                swarmify(model, swarm, k_best=2, experts_per_layer=2, wait=0.5)
            specs = swarm.run(read_specs, swarm.dht)
            assert [(s.pattern, s.kind, s.hidden_dim, s.inner_width) for s in specs] == \
                [("swarm.[0:2].[0:2]", "relu_ffn@32", HIDDEN, 32)]
            host, port = bootstrap.rsplit(":", 1)
            plain = DaemonConfig(host="127.0.0.1", initial_peers=[(host, int(port))], seed=1)
            first = _start(bridge, plain)
            assert sorted(first.experts) == ["swarm.0.0", "swarm.0.1", "swarm.1.0", "swarm.1.1"]
            assert (first.expert_kind, first.hidden_dim, first.pattern) == ("relu_ffn@32", HIDDEN,
                                                                             "swarm.[0:2].[0:2]")
            second = _start(bridge, plain)  # the model is all served: nothing beyond its 2 layers
            assert second.experts == []
            assert any("serving none" in note for note in second.notes)
            swarmify(model, swarm, k_best=2, experts_per_layer=2, wait=10.0)
            with torch.no_grad():
                assert model(torch.randn(2, 3, HIDDEN)).shape == (2, 3, HIDDEN)
            status = swarm.run(gather_status, swarm.rpc, swarm.dht)
    kinds = {row["peer_id"]: row["expert_kind"] for row in status["peers"]}
    assert kinds[first.peer_id] == "relu_ffn@32" and kinds[second.peer_id] is None
    assert "relu_ffn@32, hidden 16" in format_status(status)


def test_the_join_line_swarmify_prints_works_on_several_daemons():
    with Bridge.start() as bridge:
        bootstrap = _bootstrap(bridge)
        with Swarm([bootstrap]) as swarm:
            model = _model()
            with pytest.raises(SwarmNotServing) as caught:
                swarmify(model, swarm, k_best=2, experts_per_layer=2, wait=0.5, advertise=False)
            message = str(caught.value)
            assert "\n" not in message and "up to 2 machines" in message
            command = message[message.index("peer join"):]
            assert f"--initial-peers {bootstrap} " in command  # the swarm's own address, not a placeholder
            argv = shlex.split(command)[1:]
            infos = []
            for index in range(3):
                options = join_options(build_parser().parse_args([*argv, "--host", "127.0.0.1"]))
                options.pop("log_level", None)
                infos.append(_start(bridge, DaemonConfig(**options, seed=index)))
            served = sorted(uid for info in infos for uid in info.experts)
            assert served == ["swarm.0.0", "swarm.0.1", "swarm.1.0", "swarm.1.1"]  # each uid once, none beyond
            assert [len(info.experts) for info in infos] == [2, 2, 0]
            swarmify(model, swarm, k_best=2, experts_per_layer=2, wait=10.0)
