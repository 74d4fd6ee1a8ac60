"""Kademlia DHT: trio-native, wire-compatible with the `kademlia` package, with expiring signed records.

    async with DHTNode.open(host, port, initial_peers=[(h, p)], identity=..., network=...,
                            client_mode=False, clock=time.time) as node:
        await node.store(key, value, expiration_time, subkey=None, signed=False) -> bool
        await node.get(key, latest=False) -> Record | None
        await node.store_many([(key, value, expiration_time, subkey), ...]) -> list[bool]
        await node.get_many([key, ...], latest=False) -> {key: Record | None}
        node.peer_id, node.address, node.now(), node.stats(), node.local_record(key)

Callers outside `dht` type their handles with `client.DHTClient` (what they use of a node) and
`client.SwarmHandle` (a trainer's bridge + RPC node + DHT node).

Modules: `protocol` (rpcudp framing, sans-I/O), `records` (envelope, merge rule, signatures), `lookup` (iterative
lookup state), `routing` (k-buckets), `peers` (RTT, rate limits), `storage` (held records), `server` (request
handling, sans-I/O), `policy` (routing-table entry, welcome, read repair, per-IP limit; sans-I/O), `node` (the
trio driver).
A value stored with `expiration_time=math.inf`, no subkey and no signature is a plain stock value; everything
else travels as a swarmd record envelope inside a bytes value (see dht/records.py).
"""

from dht.client import DHTClient, SwarmHandle
from dht.errors import BootstrapFailed, DHTError, InvalidKey, InvalidValue, RequestTimeout, ValueTooLarge
from dht.node import DHTConfig, DHTNode, key_id_of
from dht.records import Entry, Record

__all__ = [
    "BootstrapFailed", "DHTClient", "DHTConfig", "DHTError", "DHTNode", "Entry", "InvalidKey", "InvalidValue",
    "Record", "RequestTimeout", "SwarmHandle", "ValueTooLarge", "key_id_of",
]
