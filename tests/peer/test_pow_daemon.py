"""Proof-of-work PeerIDs through the daemon (`peer join --dht-id-difficulty BITS`), separate daemons on 127.0.0.1.

A daemon asked for BITS makes its identity carry them (and keeps it in its --identity file); an identity file
without them stops the start with one line; daemons of a swarm that asks for work keep a daemon whose PeerID
lacks it out of their routing tables and lookups (its requests are still answered: it is simply never routed
to).
"""

from __future__ import annotations

import dataclasses

import pytest
import trio

from dht.routing import has_work, work_bits
from peer.daemon import Daemon, DaemonConfig, StartupError
from peer.p2p.identity import Identity

BITS = 6
TEST_DEADLINE = 120.0


async def start(nursery: trio.Nursery, config: DaemonConfig, identity: Identity | None = None) -> Daemon:
    daemon = Daemon(dataclasses.replace(config, host="127.0.0.1"), identity=identity)  # never the real interfaces
    await nursery.start(daemon.run)
    return daemon


def test_the_daemon_makes_and_keeps_an_identity_with_the_work_and_refuses_one_without(tmp_path):
    path = tmp_path / "id.key"
    made = Daemon(DaemonConfig(host="127.0.0.1", identity=path, dht_id_difficulty=BITS)).identity
    assert has_work(made.peer_id, BITS) and path.exists()
    again = Daemon(DaemonConfig(host="127.0.0.1", identity=path, dht_id_difficulty=BITS)).identity
    assert again.peer_id == made.peer_id  # made once, then kept
    lazy = Identity.generate()
    while work_bits(lazy.peer_id) >= BITS:
        lazy = Identity.generate()
    lazy_path = tmp_path / "lazy.key"
    lazy.save(lazy_path)
    with pytest.raises(StartupError) as refused:
        Daemon(DaemonConfig(host="127.0.0.1", identity=lazy_path, dht_id_difficulty=BITS))
    assert "\n" not in str(refused.value) and "--identity" in str(refused.value)


async def test_daemons_that_ask_for_work_never_route_to_a_peer_without_it():
    lazy = Identity.generate()
    while work_bits(lazy.peer_id) >= BITS:
        lazy = Identity.generate()
    with trio.fail_after(TEST_DEADLINE):
        async with trio.open_nursery() as nursery:
            config = DaemonConfig(experts="ffn.[0:1]", hidden_dim=8, dht_id_difficulty=BITS, reachability="public")
            first = await start(nursery, config)
            second = await start(nursery, dataclasses.replace(config, experts="ffn.[1:2]",
                                                              initial_peers=[first.rpc.address]))
            # a volunteer without the work (it asks for none itself, so it starts) joins through the first
            outsider = await start(nursery, DaemonConfig(experts="ffn.[2:3]", hidden_dim=8, reachability="public",
                                                         initial_peers=[first.rpc.address]), identity=lazy)
            while second.identity.peer_id not in first.dht.routing_table_ids():
                await trio.sleep(0.01)
            # the outsider routes to them (it asked for no work), they never to it
            while not set(outsider.dht.routing_table_ids()) & {first.identity.peer_id, second.identity.peer_id}:
                await trio.sleep(0.01)
            await first.dht.store("pow:note", b"kept", first.dht.now() + 60)
            for daemon in (first, second):
                assert lazy.peer_id not in daemon.dht.routing_table_ids()
            # it knocked (its bootstrap and lookups reach the first daemon), and was refused a table slot
            assert first.dht.stats()["dropped"]["table_insufficient_work"] >= 1
            nursery.cancel_scope.cancel()
