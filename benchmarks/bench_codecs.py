"""Pseudo-gradient codecs of the wire (peer/p2p/wire.py): size, error and speed of each on a realistic pseudo-gradient.

The input is what a DiLoCo outer round sends: the difference of two nearby float32 weight tensors (weights ~
N(0, 0.02^2), moved by heavy-tailed steps: Student-t(3) noise times a log-normal scale per row of 1024 elements,
as rows of a layer move at different rates). For each codec (none, float16, int8, int4, int2, topk2, topk8):

- bytes ratio: tensor data sent (`wire.data_nbytes`, what the traffic counters add) / float32's 4 bytes per element;
- relative L2 error: ||x - decode(encode(x))|| / ||x|| (for the top-k codecs also the error of sending the
  same kept coordinates exactly: what the value codes add on top of what top-k drops);
- encode and decode seconds (best of `--repeats`): `wire.encode` to parts, joined into one received buffer, then
  `wire.decode`, scaled to 100M elements.

`--blocks` also prints INT4's and INT2's error and size for blocks of 32 to 256 elements (why 64).

    .venv/bin/python benchmarks/bench_codecs.py [--elements 100000000] [--repeats 2] [--blocks]

The last line of output is one JSON object; `codec_s_per_100m` is the faster sparse codec's encode + decode time
per 100M elements (target: <= 2 s on this 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from peer.p2p import wire  # noqa: E402

CODECS = ["none", "float16", "int8", "int4", "int2", "topk2", "topk8"]
SPARSE = ["topk2", "topk8"]


def pseudo_gradient(numel: int, seed: int = 0) -> torch.Tensor:
    """w_after - w_before for nearby weights, with heavy-tailed steps whose scale varies by row."""
    generator = torch.Generator().manual_seed(seed)
    before = torch.randn(numel, generator=generator).mul_(0.02)
    step = torch.randn(numel, generator=generator)
    chi2 = torch.zeros(numel)
    for _ in range(3):  # Student-t(3) = N(0, 1) / sqrt(chi2_3 / 3)
        chi2.addcmul_(noise := torch.randn(numel, generator=generator), noise)
    step.div_(chi2.div_(3).sqrt_())
    del chi2
    rows = -(-numel // 1024)
    row_scale = torch.randn(rows, generator=generator).exp_().mul_(1e-3)
    padded = torch.nn.functional.pad(step, (0, rows * 1024 - numel)).view(rows, 1024).mul_(row_scale.unsqueeze(1))
    after = before + padded.view(-1)[:numel]
    return after.sub_(before)


def measure(x: torch.Tensor, name: str, repeats: int, density: float | None) -> dict[str, float]:
    codec = wire.Compression[name.upper()]
    item = wire.compressed(x, codec, density=density)
    best_encode = best_decode = float("inf")
    decoded = x
    for _ in range(repeats):
        del decoded
        started = time.perf_counter()
        parts = wire.encode([item])
        buffer = wire.message_buffer(wire.parts_nbytes(parts))
        cursor = 0
        for part in parts:  # what the receiver holds: the message in one buffer
            size = part.nbytes if isinstance(part, memoryview) else len(part)
            buffer[cursor: cursor + size] = part
            cursor += size
        del parts
        encoded = time.perf_counter()
        decoded = wire.decode(buffer)[0]
        done = time.perf_counter()
        best_encode, best_decode = min(best_encode, encoded - started), min(best_decode, done - encoded)
        del buffer
    error = float((decoded.double() - x.double()).norm() / x.double().norm())
    scale = 1e8 / x.numel()
    figures = {}
    if name in SPARSE:  # what the kept coordinates would give if their values were sent exactly
        dropped = x.double().masked_fill(decoded != 0, 0.0)
        figures["keep_only_rel_l2_error"] = float(dropped.norm() / x.double().norm())
    return figures | {
        "bytes_ratio": wire.data_nbytes(item) / (4 * x.numel()),
        "rel_l2_error": error,
        "encode_s_per_100m": best_encode * scale,
        "decode_s_per_100m": best_decode * scale,
        "s_per_100m": (best_encode + best_decode) * scale,
    }


def blocks_table(x: torch.Tensor) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    original = wire.INT4_BLOCK, wire.INT2_BLOCK
    try:
        for block in (32, 64, 128, 256):
            wire.INT4_BLOCK = wire.INT2_BLOCK = block
            for name in ("int4", "int2"):
                codec = wire.Compression[name.upper()]
                y = wire.roundtrip(x, codec)
                table[f"{name}_block{block}"] = {
                    "bytes_ratio": wire.data_nbytes(x, codec) / (4 * x.numel()),
                    "rel_l2_error": float((y - x).norm() / x.norm()),
                }
    finally:
        wire.INT4_BLOCK, wire.INT2_BLOCK = original
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--density", type=float, default=None, help="top-k density (default: the wire's default)")
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--blocks", action="store_true", help="INT4/INT2 error and size by block size")
    args = parser.parse_args()

    torch.manual_seed(0)
    started = time.perf_counter()
    x = pseudo_gradient(args.elements)
    print(f"pseudo-gradient of {args.elements:,} float32 elements made in {time.perf_counter() - started:.1f} s "
          f"({torch.get_num_threads()} threads); top-k density "
          f"{args.density if args.density is not None else wire.default_density()}", flush=True)
    results: dict[str, dict[str, float]] = {}
    print(f"{'codec':>8} {'bytes/fp32':>11} {'rel L2 err':>11} {'enc s/100M':>11} {'dec s/100M':>11} "
          f"{'s/100M':>8}")
    for name in args.codecs.split(","):
        figures = results[name] = measure(x, name, args.repeats, args.density)
        print(f"{name:>8} {figures['bytes_ratio']:>11.5f} {figures['rel_l2_error']:>11.4f} "
              f"{figures['encode_s_per_100m']:>11.3f} {figures['decode_s_per_100m']:>11.3f} "
              f"{figures['s_per_100m']:>8.3f}"
              + (f"   (kept values exact: {figures['keep_only_rel_l2_error']:.4f})" if name in SPARSE else ""),
              flush=True)
    summary: dict[str, object] = {"elements": args.elements, "threads": torch.get_num_threads(),
                                  "density": args.density if args.density is not None else wire.default_density(),
                                  "codecs": results}
    if args.blocks:
        sample = x[: min(x.numel(), 16_000_000)]
        table = blocks_table(sample)
        for key, figures in table.items():
            print(f"{key:>14}: bytes/fp32 {figures['bytes_ratio']:.5f}, rel L2 error {figures['rel_l2_error']:.4f}")
        summary["blocks"] = table
    sparse = [results[name]["s_per_100m"] for name in SPARSE if name in results]
    if sparse:
        summary["codec_s_per_100m"] = min(sparse)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
