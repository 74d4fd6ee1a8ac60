"""The content hash of a list of tensors, and its manifest: what lets a state be fetched in verified blocks.

Definition (version 1). Concatenate the raw bytes of the tensors, in order, each in its own dtype and native
(little-endian) byte order, row-major; cut the result into blocks of `block_bytes` (the last one may be shorter;
an empty state has no block). Then

    header = "swarmd.state.v1;<block_bytes>;<dtype>:<d0>,<d1>,...;<dtype>:...;"    (ASCII)
    root   = sha256(len(header) as 8 bytes little-endian || header || sha256(block 0) || sha256(block 1) || ...)

`state_digest(tensors)` is the first 32 hex characters of `root` with `block_bytes = BLOCK_BYTES` (1 MiB, part of
the definition): equal states give equal digests in every process, and any difference in a byte, a dtype, a shape
or in how the bytes are split among the tensors gives another one. Dtypes are named as `str(dtype)` without the
"torch." prefix (the names the wire uses). The digest has the format of `averaging.diloco.state_hash` (32 hex
characters) and takes the same argument, a list of tensors, so it can replace it.

The `Manifest` is the header's content plus the block digests: a downloader checks a manifest against an agreed
digest (recomputing the root from the block digests, cheap), then checks each block it receives against its
digest before using it, so a block from any holder of the same root can be trusted, and a holder that sends other
bytes is caught at the first bad block.

Speed: one pass over the bytes with hashlib's sha256 on memoryviews of the tensors' storage (no copy for
contiguous CPU tensors); hashlib releases the GIL for large updates, so a big state can be hashed in a worker
thread while the event loop runs. Measured on the 2-core development machine (SHA extensions): about 1.8 GB/s.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch

from peer.p2p import wire

BLOCK_BYTES = 1 << 20
"""Bytes per block in the definition of `state_digest` (the last block of a state may be shorter)."""
DIGEST_CHARS = 32
"""Hex characters kept of the root (128 bits), as `averaging.diloco.state_hash` does."""
DIGEST_BYTES = 32
"""Bytes of one block digest (a full sha256)."""
MIN_BLOCK_BYTES = 1
MAX_BLOCK_BYTES = 1 << 26
_VERSION = "swarmd.state.v1"
_HEX = re.compile(r"[0-9a-f]{32}")

Segment = tuple[int, int, int]
"""(tensor index, first byte, end byte) of one block's piece inside one tensor's bytes."""


class ManifestError(ValueError):
    """A manifest received from a peer is malformed or not consistent with its own root."""


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _header(block_bytes: int, dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> bytes:
    parts = [_VERSION, str(block_bytes)]
    parts += [f"{dtype}:{','.join(str(int(d)) for d in shape)}" for dtype, shape in zip(dtypes, shapes)]
    return (";".join(parts) + ";").encode("ascii")


def _root(block_bytes: int, dtypes: Sequence[str], shapes: Sequence[Sequence[int]], digests: Iterable[bytes]) -> str:
    header = _header(block_bytes, dtypes, shapes)
    root = hashlib.sha256(len(header).to_bytes(8, "little"))
    root.update(header)
    for digest in digests:
        root.update(digest)
    return root.hexdigest()[:DIGEST_CHARS]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of `tensor` as a flat memoryview: over its own storage when it is a contiguous CPU tensor (no
    copy), else over a contiguous CPU copy."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:  # one element counts as contiguous with any stride
        flat = flat.as_strided((flat.numel(),), (1,))
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # buffer protocol


def segments_of(sizes: Sequence[int], start: int, end: int) -> list[Segment]:
    """The pieces of the byte range [start, end) of the concatenation of tensors of `sizes` bytes."""
    pieces: list[Segment] = []
    offset = 0
    for index, size in enumerate(sizes):
        if offset >= end:
            break
        low, high = max(start, offset), min(end, offset + size)
        if low < high:
            pieces.append((index, low - offset, high - offset))
        offset += size
    return pieces


def _block_digests(views: Sequence[memoryview], block_bytes: int) -> Iterator[bytes]:
    """sha256 of each block of the concatenation of `views`, in one pass, without copying."""
    current = hashlib.sha256()
    room = block_bytes
    for view in views:
        position, size = 0, view.nbytes
        while position < size:
            take = min(room, size - position)
            current.update(view[position:position + take])
            position += take
            room -= take
            if room == 0:
                yield current.digest()
                current, room = hashlib.sha256(), block_bytes
    if room != block_bytes:
        yield current.digest()


@dataclass(frozen=True)
class Manifest:
    """The layout of a state (dtype names, shapes, bytes per tensor), its block size and block digests, and its
    root (`state_digest` when `block_bytes == BLOCK_BYTES`)."""

    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    block_bytes: int
    digests: tuple[bytes, ...]
    root: str

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def num_blocks(self) -> int:
        return len(self.digests)

    def block_range(self, index: int) -> tuple[int, int]:
        start = index * self.block_bytes
        return start, min(start + self.block_bytes, self.total_bytes)

    def block_size(self, index: int) -> int:
        start, end = self.block_range(index)
        return end - start

    def segments(self, index: int) -> list[Segment]:
        """Where block `index` lies in the tensors: (tensor, first byte, end byte) pieces, in order."""
        return segments_of(self.sizes, *self.block_range(index))

    def verify_block(self, index: int, parts: Sequence[memoryview | bytes]) -> bool:
        """Whether `parts`, concatenated, are exactly block `index` (its size and its digest)."""
        if not 0 <= index < self.num_blocks:
            return False
        digest = hashlib.sha256()
        size = 0
        for part in parts:
            view = memoryview(part)
            size += view.nbytes
            digest.update(view)
        return size == self.block_size(index) and digest.digest() == self.digests[index]

    def same_layout(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether `tensors` have this manifest's dtypes and shapes (so the state can be copied into them)."""
        return len(tensors) == len(self.dtypes) and all(
            dtype_label(t.dtype) == dtype and tuple(t.shape) == shape
            for t, dtype, shape in zip(tensors, self.dtypes, self.shapes))

    def to_wire(self) -> dict[str, Any]:
        return {"v": 1, "block_bytes": self.block_bytes, "root": self.root,
                "tensors": [[dtype, list(shape)] for dtype, shape in zip(self.dtypes, self.shapes)],
                "digests": b"".join(self.digests)}

    @classmethod
    def from_wire(cls, obj: Any, *, max_tensors: int = 1 << 20) -> "Manifest":
        """Parse and check a manifest a peer sent: well-formed, dtypes the wire knows, and a root that is the hash
        of its own layout and block digests (ManifestError otherwise). Whether the root is the one wanted is
        the caller's business."""
        if not isinstance(obj, dict) or obj.get("v") != 1:
            raise ManifestError("not a version-1 manifest")
        block_bytes, root, layout, digests = (obj.get("block_bytes"), obj.get("root"), obj.get("tensors"),
                                              obj.get("digests"))
        if type(block_bytes) is not int or not MIN_BLOCK_BYTES <= block_bytes <= MAX_BLOCK_BYTES:
            raise ManifestError(f"block size {block_bytes!r} out of range")
        if not isinstance(root, str) or not _HEX.fullmatch(root):
            raise ManifestError("malformed root")
        if not isinstance(layout, list) or len(layout) > max_tensors:
            raise ManifestError("malformed tensor list")
        if not isinstance(digests, bytes) or len(digests) % DIGEST_BYTES:
            raise ManifestError("malformed block digests")
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        sizes: list[int] = []
        itemsizes: dict[torch.dtype, int] = {}
        for entry in layout:
            if not isinstance(entry, list) or len(entry) != 2:
                raise ManifestError("malformed tensor entry")
            name, shape = entry
            dtype = wire.dtype_from_name(name)
            if dtype is None or not isinstance(name, str):
                raise ManifestError(f"unknown dtype {name!r}")
            if not isinstance(shape, list) or len(shape) > 64 or not all(
                    type(d) is int and 0 <= d < 1 << 48 for d in shape):
                raise ManifestError(f"malformed shape {shape!r}")
            dtypes.append(name)
            shapes.append(tuple(shape))
            if dtype not in itemsizes:
                itemsizes[dtype] = torch.empty((), dtype=dtype).element_size()
            sizes.append(math.prod(shape) * itemsizes[dtype])
        total = sum(sizes)
        count = len(digests) // DIGEST_BYTES
        if count != -(-total // block_bytes):
            raise ManifestError(f"{count} block digests for {total} bytes in blocks of {block_bytes}")
        blocks = tuple(digests[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] for i in range(count))
        if _root(block_bytes, dtypes, shapes, blocks) != root:
            raise ManifestError("the root is not the hash of the manifest's layout and blocks")
        return cls(tuple(dtypes), tuple(shapes), tuple(sizes), block_bytes, blocks, root)


def state_manifest(tensors: Sequence[torch.Tensor], block_bytes: int = BLOCK_BYTES) -> Manifest:
    """The manifest of `tensors` (layout, block digests, root) in one pass over their bytes."""
    if not MIN_BLOCK_BYTES <= block_bytes <= MAX_BLOCK_BYTES:
        raise ValueError(f"block_bytes must be in [{MIN_BLOCK_BYTES}, {MAX_BLOCK_BYTES}]")
    dtypes = tuple(dtype_label(t.dtype) for t in tensors)
    shapes = tuple(tuple(int(d) for d in t.shape) for t in tensors)
    sizes = tuple(t.numel() * t.element_size() for t in tensors)
    digests = tuple(_block_digests([byte_view(t) for t in tensors], block_bytes))
    return Manifest(dtypes, shapes, sizes, block_bytes, digests, _root(block_bytes, dtypes, shapes, digests))


def state_digest(tensors: Sequence[torch.Tensor]) -> str:
    """The content hash of `tensors` (32 hex characters; see the module doc): equal iff dtypes, shapes and bytes
    are equal. The root of `state_manifest(tensors)`."""
    return state_manifest(tensors).root


__all__ = ["BLOCK_BYTES", "DIGEST_CHARS", "Manifest", "ManifestError", "Segment", "byte_view", "dtype_label",
           "segments_of", "state_digest", "state_manifest"]
