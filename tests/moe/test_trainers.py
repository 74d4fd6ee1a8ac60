"""Who may train an expert: a daemon started with `--trainers FILE` lets only the listed PeerIDs call backward
(single and batched); anyone else gets the typed `NotAllowed` over the wire, nothing is computed and the weights
stay as they were, while forward still answers it. `--forward-from` closes forward the same way. Real sockets on
127.0.0.1, the daemon and each caller a separate peer with its own identity."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import trio

from moe import calls
from moe.errors import NotAllowed
from moe.server import read_peer_list
from peer.daemon import Daemon, DaemonConfig, StartupError
from peer.p2p.identity import Identity
from peer.p2p.net import RealNetwork
from peer.p2p.rpc import RPCNode

HIDDEN = 8


async def start(nursery: trio.Nursery, config: DaemonConfig) -> Daemon:
    daemon = Daemon(dataclasses.replace(config, host="127.0.0.1"))
    await nursery.start(daemon.run)
    return daemon


def weights(daemon: Daemon) -> dict[str, list[torch.Tensor]]:
    assert daemon.expert_server is not None
    return {uid: [p.detach().clone() for p in expert.module.parameters()]
            for uid, expert in daemon.expert_server.experts.items()}


def same(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(x, y) for uid in a for x, y in zip(a[uid], b[uid]))


async def test_only_listed_trainers_step_the_experts_and_forward_stays_open(tmp_path):
    trainer, outsider = Identity.generate(), Identity.generate()
    allow = tmp_path / "trainers"
    allow.write_text(f"# who may train\n{trainer.peer_id.hex()}  # the lab's trainer\n\n")
    x, grads = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    async with trio.open_nursery() as nursery:
        daemon = await start(nursery, DaemonConfig(experts="ffn.[0:2]", hidden_dim=HIDDEN, seed=0, trainers=allow))
        assert daemon.rpc is not None
        address = daemon.rpc.address
        server_id = daemon.rpc.peer_id
        async with RPCNode(outsider, RealNetwork()) as other, RPCNode(trainer, RealNetwork()) as allowed:
            before = weights(daemon)
            with trio.fail_after(30):
                with pytest.raises(NotAllowed) as refused:
                    await calls.backward(other, address, server_id, "ffn.0", [x], [grads], timeout=10)
                assert refused.value.peer == server_id and refused.value.method == calls.BACKWARD
                assert outsider.peer_id.hex() in str(refused.value) and "--trainers" in str(refused.value)
                with pytest.raises(NotAllowed):
                    await calls.backward_batch(other, address, server_id, [("ffn.0", [x], [grads]),
                                                                           ("ffn.1", [x], [grads])], timeout=10)
                assert same(before, weights(daemon))
                assert all(e.steps == 0 for e in daemon.expert_server.experts.values())
                # forward still answers the outsider, single and batched
                outputs = await calls.forward(other, address, server_id, "ffn.0", [x], timeout=10)
                assert outputs[0].shape == (3, HIDDEN)
                answers = await calls.forward_batch(other, address, server_id, [("ffn.0", [x]), ("ffn.1", [x])],
                                                    timeout=10)
                assert all(not isinstance(answer, Exception) for answer in answers)
                # the listed trainer trains
                await calls.backward(allowed, address, server_id, "ffn.0", [x], [grads], timeout=10)
                await calls.backward_batch(allowed, address, server_id, [("ffn.1", [x], [grads])], timeout=10)
            assert not same(before, weights(daemon))
            assert [e.steps for _, e in sorted(daemon.expert_server.experts.items())] == [1, 1]
            assert daemon.status()["experts"]["errors"]["not_allowed"] == 2
            # every step is bounded by default (peer join --clip-grad-norm 1.0)
            assert all(e.clip_grad_norm == 1.0 for e in daemon.expert_server.experts.values())
        nursery.cancel_scope.cancel()


async def test_forward_from_closes_forward_to_others(tmp_path):
    caller, outsider = Identity.generate(), Identity.generate()
    allow = tmp_path / "forward"
    allow.write_text(caller.peer_id.hex() + "\n")
    x = torch.randn(2, HIDDEN)
    async with trio.open_nursery() as nursery:
        daemon = await start(nursery, DaemonConfig(experts="ffn.[0:1]", hidden_dim=HIDDEN, forward_from=allow,
                                                   clip_grad_norm=0.0))
        assert daemon.expert_server is not None and daemon.expert_server.experts["ffn.0"].clip_grad_norm is None
        assert daemon.rpc is not None
        async with RPCNode(outsider, RealNetwork()) as other, RPCNode(caller, RealNetwork()) as listed:
            with trio.fail_after(30):
                with pytest.raises(NotAllowed):
                    await calls.forward(other, daemon.rpc.address, daemon.rpc.peer_id, "ffn.0", [x], timeout=10)
                with pytest.raises(NotAllowed):
                    await calls.forward_batch(other, daemon.rpc.address, daemon.rpc.peer_id, [("ffn.0", [x])],
                                              timeout=10)
                await calls.forward(listed, daemon.rpc.address, daemon.rpc.peer_id, "ffn.0", [x], timeout=10)
                # info stays open: it is what a caller needs to know the schema, and changes nothing
                info = await calls.info(other, daemon.rpc.address, daemon.rpc.peer_id, "ffn.0", timeout=10)
                assert info["uid"] == "ffn.0"
        nursery.cancel_scope.cancel()


def test_allow_list_file_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "list"
    bad.write_text("ab" * 20 + "\nnot-a-peer\n")
    with pytest.raises(ValueError, match=r"list:2: 'not-a-peer' is not a PeerID"):
        read_peer_list(bad)
    bad.write_text("zz" * 20 + "\n")
    with pytest.raises(ValueError, match=r"list:1"):
        read_peer_list(bad)
    good = tmp_path / "good"
    good.write_text("AB" * 20 + "\n# nobody else\n")
    assert read_peer_list(good) == frozenset({"ab" * 20})


async def test_a_missing_allow_list_stops_the_start(tmp_path):
    daemon = Daemon(DaemonConfig(host="127.0.0.1", experts="ffn.[0:1]", hidden_dim=HIDDEN,
                                 trainers=tmp_path / "missing"))
    with trio.fail_after(30), pytest.raises(StartupError, match="--trainers .*missing"):
        await daemon.run()


@pytest.mark.slow
def test_peer_join_trainers_in_a_separate_process(tmp_path):
    """The same through the CLI: `peer join --trainers FILE` in its own process; the weights are watched from
    outside through forward outputs (unchanged after the refused backward, changed after the allowed one)."""
    from peer.testing.peer_processes import run_peer, start_daemon, stop_all

    trainer, outsider = Identity.generate(), Identity.generate()
    allow = tmp_path / "trainers"
    allow.write_text(trainer.peer_id.hex() + "\n")
    process, peer_hex, address_text = start_daemon("--experts", "ffn.[0:1]", "--hidden-dim", str(HIDDEN),
                                                   "--trainers", str(allow))
    host, port = address_text.rsplit(":", 1)
    address = (host, int(port))
    x, grads = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)

    async def scenario() -> list[torch.Tensor]:
        from peer.p2p.identity import PeerID

        server_id = PeerID.from_hex(peer_hex)
        outputs = []
        async with RPCNode(outsider, RealNetwork()) as other, RPCNode(trainer, RealNetwork()) as allowed:
            with trio.fail_after(60):
                outputs.append((await calls.forward(other, address, server_id, "ffn.0", [x], timeout=20))[0])
                with pytest.raises(NotAllowed):
                    await calls.backward(other, address, server_id, "ffn.0", [x], [grads], timeout=20)
                outputs.append((await calls.forward(other, address, server_id, "ffn.0", [x], timeout=20))[0])
                await calls.backward(allowed, address, server_id, "ffn.0", [x], [grads], timeout=20)
                outputs.append((await calls.forward(other, address, server_id, "ffn.0", [x], timeout=20))[0])
        return outputs

    try:
        before, after_refused, after_allowed = trio.run(scenario)
    finally:
        stop_all([process])
    assert torch.equal(before, after_refused)
    assert not torch.equal(before, after_allowed)

    bad = tmp_path / "bad"
    bad.write_text("nope\n")
    result = run_peer("join", "--experts", "ffn.[0:1]", "--hidden-dim", str(HIDDEN), "--trainers", str(bad))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"peer: error: --trainers {bad}:1: 'nope' is not a PeerID "
                                                  "(40 hex digits)"], result.stderr
