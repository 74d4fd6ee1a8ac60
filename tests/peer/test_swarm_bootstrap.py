"""`Swarm(initial_peers=[])` starts a swarm (the first trainer is its own bootstrap) and a string of addresses is
taken where a list is expected: separate peers on 127.0.0.1 sockets, no `peer join` daemon."""

from __future__ import annotations

import pytest

from peer.client import Swarm, normalize_peers


def test_the_first_trainer_is_the_bootstrap_and_a_string_of_addresses_joins_it():
    with Swarm(initial_peers=[], host="127.0.0.1") as first:
        assert first.address is not None and first.address.startswith("127.0.0.1:")
        assert not first.dht.client_mode  # others store their records on it
        with Swarm(initial_peers=first.address) as second, Swarm(f" {first.address}, ") as third:

            async def store() -> bool:
                return await second.dht.store("greeting", "hello", second.dht.now() + 60)

            assert second.run(store)

            async def read() -> object:
                record = await third.dht.get("greeting", latest=True)
                return None if record is None else record.value

            assert third.run(read) == "hello"


def test_a_bad_initial_peer_is_one_line_naming_it():
    for bad in ("1", "host:notaport", ["127.0.0.1"]):
        with pytest.raises(ValueError) as caught:
            Swarm(initial_peers=bad, start=False)
        assert "\n" not in str(caught.value) and "HOST:PORT" in str(caught.value)
    assert normalize_peers("a:1,b:2 c:3") == [("a", 1), ("b", 2), ("c", 3)]
