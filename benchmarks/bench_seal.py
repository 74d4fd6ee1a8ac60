"""Seal-path benchmark: what the sealed channel adds to moving tensor messages, in one process, CPU time only.

Why its own script: bench_averaging (b) runs 8 peer processes on the machine's cores, so its per-step CPU says
the sealed channel costs more than the unsealed one, but not whether that is the cipher (unavoidable) or our
record handling around it (ours to fix). Here one `RPCConnection` pair (the sans-I/O core, no sockets) carries
`push` calls of 2.4 MB float32 tensors (bench_averaging (b)'s part size), cycling through 48 MB of distinct
tensors so that caches are as cold as in a round; a copy into and out of an 8 MiB buffer stands for the kernel
(the receiver reads at most 64 KiB per "system call", as a socket read does). Each figure is process CPU time per
MB moved, for:
- `unsealed_ms_per_mb`: an `--insecure-transport` connection;
- `sealed_ms_per_mb`: the default sealed connection (AES-256-GCM records of up to 1 MiB), and
  `sealed_RECORDk_ms_per_mb` for smaller records (`--records`), to see whether record size matters;
- `cipher_ms_per_mb`: the bare cipher on the same bytes, `AESGCM.encrypt_into` plus `decrypt_into` of 1 MiB
  records (the floor any sealed channel pays);
- `sealed_extra_ms_per_mb` = sealed - unsealed, and `extra_over_cipher` = that / cipher: at or below 1.0 our
  record handling costs nothing beyond the cipher's own pass (decryption replaces the kernel's copy into the
  message buffer, so it can be below 1).
Medians over `--repeats` interleaved runs. The last line of output is one JSON object.

Usage: python benchmarks/bench_seal.py [--repeats 5] [--messages 120] [--records 256 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from peer.p2p import rpc_protocol, seal  # noqa: E402
from peer.p2p.identity import Identity  # noqa: E402

PART_NUMEL = 600_000  # 2.4 MB of float32: one part of bench_averaging (b)'s 9.5 MB in groups of 4
TENSORS = 20  # 48 MB cycled through
READ_BYTES = 64 * 1024  # what one receive returns at most, as a socket read would
KERNEL = bytearray(8 << 20)


def connection_pair(sealed: bool, record_bytes: int) -> tuple[rpc_protocol.RPCConnection,
                                                                rpc_protocol.RPCConnection]:
    to_b, to_a = os.urandom(seal.KEY_BYTES), os.urandom(seal.KEY_BYTES)
    a_id, b_id = Identity.generate().peer_id, Identity.generate().peer_id
    a = rpc_protocol.RPCConnection(initiator=True, peer_id=b_id,
                                   keys=seal.SessionKeys(to_b, to_a) if sealed else None)
    b = rpc_protocol.RPCConnection(initiator=False, peer_id=a_id, methods={"push"},
                                   keys=seal.SessionKeys(to_a, to_b) if sealed else None)
    if a.sealer is not None:
        a.sealer.max_record_bytes = record_bytes
    return a, b


def move(a: rpc_protocol.RPCConnection, b: rpc_protocol.RPCConnection) -> int:
    """Carry what `a` has to send to `b` through the stand-in kernel buffer; returns the requests `b` got."""
    requests = 0
    for buffer in a.data_to_send(0.0):
        view = memoryview(buffer).cast("B")
        while view:
            piece, view = view[:len(KERNEL)], view[len(KERNEL):]
            kernel = memoryview(KERNEL)[:len(piece)]
            kernel[:] = piece
            while kernel:
                target = b.receive_target()
                if target is None:
                    events = b.receive_data(kernel[:READ_BYTES], 0.0)
                    kernel = kernel[READ_BYTES:]
                else:
                    n = min(len(target), len(kernel), READ_BYTES)
                    target[:n] = kernel[:n]
                    kernel = kernel[n:]
                    events = b.advance(n, 0.0)
                requests += sum(1 for event in events if type(event) is rpc_protocol.RequestReceived)
    return requests


def channel_ms_per_mb(tensors: list[torch.Tensor], messages: int, *, sealed: bool, record_bytes: int) -> float:
    a, b = connection_pair(sealed, record_bytes)
    received = 0
    started = time.process_time()
    for index in range(messages):
        a.start_call("push", {"data": [tensors[index % len(tensors)]]}, deadline=1e9, now=0.0)
        while a.outbox:
            received += move(a, b)
    seconds = time.process_time() - started
    assert received == messages, (received, messages)
    return seconds * 1e3 / (messages * PART_NUMEL * 4 / 1e6)


def cipher_ms_per_mb(tensors: list[torch.Tensor], messages: int) -> float:
    aead = AESGCM(os.urandom(seal.KEY_BYTES))
    record = seal.MAX_RECORD_BYTES
    sealed = bytearray(record + seal.TAG_BYTES)
    opened = bytearray(record)
    nonce, header = bytes(12), bytes(4)
    total = 0
    started = time.process_time()
    for index in range(messages):
        data = memoryview(tensors[index % len(tensors)].numpy()).cast("B")
        for offset in range(0, len(data), record):
            piece = data[offset:offset + record]
            aead.encrypt_into(nonce, piece, header, memoryview(sealed)[:len(piece) + seal.TAG_BYTES])
            aead.decrypt_into(nonce, memoryview(sealed)[:len(piece) + seal.TAG_BYTES], header,
                              memoryview(opened)[:len(piece)])
            total += len(piece)
    return (time.process_time() - started) * 1e3 / (total / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--messages", type=int, default=120, help="2.4 MB messages per measurement")
    parser.add_argument("--records", type=int, nargs="*", default=[256, 64], help="smaller record sizes (KiB)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tensors = [torch.randn(PART_NUMEL) for _ in range(TENSORS)]
    runs: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        row = {"unsealed": channel_ms_per_mb(tensors, args.messages, sealed=False, record_bytes=0),
               "sealed": channel_ms_per_mb(tensors, args.messages, sealed=True, record_bytes=seal.MAX_RECORD_BYTES),
               **{f"sealed_{kib}k": channel_ms_per_mb(tensors, args.messages, sealed=True, record_bytes=kib * 1024)
                  for kib in args.records},
               "cipher": cipher_ms_per_mb(tensors, args.messages)}
        for key, value in row.items():
            runs.setdefault(key, []).append(value)
        print(f"run {repeat + 1}: " + "  ".join(f"{key} {value:.3f}" for key, value in row.items()) + " ms/MB",
              flush=True)
    figures = {f"{key}_ms_per_mb": round(statistics.median(values), 4) for key, values in runs.items()}
    extra = figures["sealed_ms_per_mb"] - figures["unsealed_ms_per_mb"]
    figures["sealed_extra_ms_per_mb"] = round(extra, 4)
    figures["extra_over_cipher"] = round(extra / figures["cipher_ms_per_mb"], 3)
    print(f"sealed adds {extra:.3f} ms/MB over unsealed; the bare cipher's two passes cost "
          f"{figures['cipher_ms_per_mb']:.3f} ms/MB (ratio {figures['extra_over_cipher']:.2f})")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
