"""The network foundation: everything a peer needs to talk to other peers, and nothing about what they say.

- `identity`: Ed25519 identities; PeerID = SHA-1 of the raw public key.
- `wire`: the one msgpack codec (zero-copy tensors, compression codecs, hard limits, the dtype table).
- `framing`: sans-I/O framing of messages into interleaved chunks.
- `handshake`: the sans-I/O handshake (who is on the other end, proven by a signed nonce).
- `rpc_protocol`: the sans-I/O connection protocol (stream ids, replies, error codes, deadlines, cancellation).
- `rpc`: authenticated RPC, the trio driver of those two cores (`RPCNode`: call, register, listen; typed errors).
- `relay`: the sans-I/O circuit relay protocol, relayed addresses, `dial_through_relays` (the dial path's relay branch).
- `relay_service`: its trio drivers: the relay service of public peers, the reservations of private ones.
- `addresses`: where a peer listens and which address it announces (listen host, route probe, free ports).
- `net`: transports — real trio sockets, or the in-memory network for deterministic simulation.
- `bridge`: a background trio thread that synchronous (PyTorch) code calls into.
- `lifetime`: the nursery an object owns its background tasks in.

Rule (tests/peer/test_layers.py enforces it): nothing here imports `dht`, `moe`, `averaging` or the application
modules of `peer`.
"""
