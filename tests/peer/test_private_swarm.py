"""Private swarms end to end (`--swarm-key`, `--allow-peers`, `peer keygen`): separate peers on 127.0.0.1.

In-process: two daemons holding one key form a swarm; a client holding it finds their experts through the DHT,
stores and reads, and calls an expert; a client with another key or none cannot join the DHT (bootstrap fails,
with a hint naming the key), its RPC call is refused with `NotInSwarm`, and it is in no routing table; an
`--allow-peers` daemon refuses unlisted peers. As processes: `peer keygen` writes 0600 and refuses to overwrite
without --force; `peer status --swarm-key` works with the key and exits 1 with one line with a wrong one.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import trio

from dht import BootstrapFailed
from moe import calls
from moe.declare import get_experts
from peer.client import open_client_peer
from peer.daemon import Daemon, DaemonConfig
from peer.p2p.identity import Identity, SwarmKey
from peer.p2p.rpc import HandshakeError, NotInSwarm
from peer.testing.peer_processes import run_peer, start_daemon, stop_all

TEST_DEADLINE = 120.0


async def start(nursery, config: DaemonConfig) -> Daemon:
    daemon = Daemon(dataclasses.replace(config, host="127.0.0.1"))  # tests never bind the real interfaces
    await nursery.start(daemon.run)
    return daemon


@pytest.fixture
def keys(tmp_path) -> dict[str, Path]:
    paths = {"swarm": tmp_path / "swarm.key", "other": tmp_path / "other.key"}
    for path in paths.values():
        SwarmKey.generate().save(path)
    return paths


async def test_holders_store_read_and_call_experts_outsiders_get_nothing(keys):
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            first = await start(nursery, DaemonConfig(experts="ffn.[0:2]", hidden_dim=8, swarm_key=keys["swarm"]))
            second = await start(nursery, DaemonConfig(experts="ffn.[2:4]", hidden_dim=8, swarm_key=keys["swarm"],
                                                       initial_peers=[first.rpc.address]))
            key = SwarmKey.load(keys["swarm"])
            async with open_client_peer([second.rpc.address], host="127.0.0.1", swarm_key=key) as (rpc, dht):
                assert await dht.store("private:note", b"members only", dht.now() + 600)
                record = await first.dht.get("private:note")
                assert record is not None and record.value == b"members only"
                location = (await get_experts(dht, ["ffn.3"]))["ffn.3"]
                assert location is not None and location.address == second.rpc.address
                (output,) = await calls.forward(rpc, location.address, None, "ffn.3", [torch.ones(2, 8)],
                                                timeout=30)
                assert output.shape == (2, 8)

            for outsider in (SwarmKey.load(keys["other"]), None):
                with pytest.raises(BootstrapFailed) as caught:
                    async with open_client_peer([first.rpc.address], host="127.0.0.1", swarm_key=outsider):
                        pass
                if outsider is not None:
                    assert "--swarm-key" in str(caught.value)
                async with open_client_peer([], host="127.0.0.1", swarm_key=outsider) as (rpc, _dht):
                    for daemon, uid in ((first, "ffn.0"), (second, "ffn.3")):
                        # another key: typed NotInSwarm; no key: the listener sent not one byte, so the outsider
                        # only saw it close (a HandshakeError that names --swarm-key)
                        with pytest.raises(NotInSwarm if outsider is not None else HandshakeError) as refused:
                            await calls.forward(rpc, daemon.rpc.address, None, uid, [torch.ones(2, 8)], timeout=30)
                        assert "\n" not in str(refused.value) and "swarm" in str(refused.value)
            for daemon in (first, second):
                while daemon.rpc.stats["handshakes_not_in_swarm"] < 2:  # the daemon's verdict, on its own task
                    await trio.sleep(0.01)
                assert set(daemon.dht.routing_table_ids()) <= {first.identity.peer_id, second.identity.peer_id}
            assert first.dht.stats()["dropped"]["bad_mac"] >= 2  # both outsiders' bootstrap datagrams, dropped
            nursery.cancel_scope.cancel()


async def test_an_allow_list_daemon_refuses_unlisted_peers(tmp_path):
    listed = Identity.generate()
    allow = tmp_path / "peers.txt"
    allow.write_text(f"# trainers\n{listed.peer_id}\n\n")
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            daemon = await start(nursery, DaemonConfig(experts="ffn.[0:1]", hidden_dim=8, allow_peers=allow))
            async with open_client_peer([daemon.rpc.address], host="127.0.0.1", identity=listed) as (rpc, _dht):
                (output,) = await calls.forward(rpc, daemon.rpc.address, None, "ffn.0", [torch.ones(1, 8)],
                                                timeout=30)
                assert output.shape == (1, 8)
            async with open_client_peer([daemon.rpc.address], host="127.0.0.1") as (rpc, _dht):
                with pytest.raises(HandshakeError, match="allow list"):
                    await calls.forward(rpc, daemon.rpc.address, None, "ffn.0", [torch.ones(1, 8)], timeout=30)
            nursery.cancel_scope.cancel()


def test_keygen_writes_0600_and_never_overwrites_without_force(tmp_path):
    path = tmp_path / "keys" / "swarm.key"
    done = run_peer("keygen", "--swarm-key", str(path))
    assert done.returncode == 0, done.stderr
    assert os.stat(path).st_mode & 0o777 == 0o600
    first = path.read_bytes()
    again = run_peer("keygen", "--swarm-key", str(path))
    assert again.returncode == 1 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert "--force" in again.stderr and "Traceback" not in again.stderr
    assert path.read_bytes() == first
    forced = run_peer("keygen", "--swarm-key", str(path), "--force")
    assert forced.returncode == 0 and path.read_bytes() != first
    assert os.stat(path).st_mode & 0o777 == 0o600
    SwarmKey.load(path)
    missing = run_peer("keygen")
    assert missing.returncode == 2 and "--swarm-key is required" in missing.stderr


@pytest.mark.slow  # a daemon process and three `peer status` runs, two of them waiting out a bootstrap
def test_peer_status_works_with_the_key_and_a_wrong_key_is_one_line_and_exit_1(keys):
    daemon, peer_id, address = start_daemon("--experts", "ffn.[0:1]", "--hidden-dim", "8",
                                            "--swarm-key", str(keys["swarm"]))
    try:
        good = run_peer("status", "--initial-peers", address, "--swarm-key", str(keys["swarm"]), "--json")
        assert good.returncode == 0, good.stderr
        assert peer_id in good.stdout
        for wrong in (["--swarm-key", str(keys["other"])], []):
            bad = run_peer("status", "--initial-peers", address, "--timeout", "2", *wrong)
            lines = bad.stderr.strip().splitlines()
            assert bad.returncode == 1 and len(lines) == 1, bad.stderr
            assert lines[0].startswith("peer: error:") and "Traceback" not in bad.stderr
            assert peer_id not in bad.stdout + bad.stderr  # nothing learned, not even who runs there
            if wrong:
                assert "--swarm-key" in lines[0]
    finally:
        stop_all([daemon])


def test_the_python_client_takes_a_key_file_or_a_key_and_bad_files_are_one_line(keys, tmp_path):
    from peer.client import Swarm
    from peer.p2p.identity import IdentityError, load_membership, load_peer_list

    swarm = Swarm(["127.0.0.1:1"], start=False, swarm_key=keys["swarm"])
    assert isinstance(swarm.swarm_key, SwarmKey)
    assert swarm.swarm_key.derive(b"t") == SwarmKey.load(keys["swarm"]).derive(b"t")
    assert load_membership(None, None) == (None, None)
    peers = tmp_path / "peers.txt"
    good, other = Identity.generate().peer_id, Identity.generate().peer_id
    peers.write_text(f"{good}  # a trainer\n\n{other.hex().upper()}\n")
    assert load_peer_list(peers) == {good, other}
    peers.write_text(f"{good}\nnot-a-peer\n")
    with pytest.raises(IdentityError, match=r"peers.txt:2: 'not-a-peer' is not a PeerID"):
        load_peer_list(peers)
    bad = run_peer("status", "--initial-peers", "127.0.0.1:1", "--swarm-key", str(tmp_path / "missing.key"))
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "cannot read swarm key file" in bad.stderr
