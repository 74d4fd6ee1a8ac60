"""Kademlia DHT: trio-native, wire-compatible with the kademlia package, with expiring signed records.

    async with DHTNode.open(host, port, initial_peers=[(h, p)], identity=..., network=...) as node:
        await node.store(key, value, expiration_time, subkey=None, signed=False) -> bool
        await node.get(key, latest=False) -> Record | None
"""

from dht.errors import BootstrapFailed, DHTError, InvalidKey, InvalidValue, RequestTimeout, ValueTooLarge
from dht.node import DHTConfig, DHTNode, key_id_of
from dht.records import Entry, Record

__all__ = [
    "BootstrapFailed", "DHTConfig", "DHTError", "DHTNode", "Entry", "InvalidKey", "InvalidValue", "Record",
    "RequestTimeout", "ValueTooLarge", "key_id_of",
]
