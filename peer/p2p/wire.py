"""The one wire codec of swarmd: msgpack plus zero-copy tensors, with hard limits and lossy compression codecs.

Every message the RPC layer, the experts and the averagers exchange goes through :func:`encode` and :func:`decode`,
so the defences against hostile peers (limits checked before allocating, typed errors, no pickle) live in one place.

Message layout (all integers little-endian)::

    [u32 body_len][msgpack body][pad][tensor buffer 0][pad][tensor buffer 1]...

The body is ordinary msgpack (``use_bin_type=True``). A tensor inside it is the extension type
:data:`TENSOR_EXT_CODE` whose payload is a small msgpack array::

    [dtype_name, shape, compression_id, offset, nbytes, params]

``offset`` counts from the start of the *data section*, which begins at the first multiple of :data:`ALIGNMENT`
at or after ``4 + body_len``; every non-empty buffer starts at a multiple of :data:`ALIGNMENT` relative to the
message start, buffers appear in body order and do not overlap, and the message ends exactly where the last buffer
ends. (Offsets are relative to the data section so that the body can be packed in one pass: its length, which
decides where the data section begins, is not known until packing is done.) ``params`` is ``[]`` except for
``Compression.UINT8`` where it is ``[min, scale]``, ``Compression.INT8``, ``INT4`` and ``INT2`` where it is
``[block]`` (the buffer then holds the blocks' float32 scales followed by the packed values), and ``TOPK2`` and
``TOPK8`` where it is ``[chunk, k]`` (see :class:`Compression` for each codec's buffer). A tensor that breaks
these rules, or its codec's, is refused with :class:`MalformedTensor`.

Why this layout: large tensors are never copied into the msgpack body. :func:`encode` hands back a list of parts
(small ``bytes`` plus ``memoryview`` objects over the tensors' own storage) that a socket can send with
scatter/gather writes, and :func:`decode` builds tensors with ``torch.frombuffer`` straight over the received
buffer when that buffer is writable, or with exactly one copy when it is read-only.

Byte order on the wire is little-endian (the tensors' native order on every platform we run on; the module refuses
to import on a big-endian host rather than silently corrupt data).
"""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    import torch

if sys.byteorder != "little":  # tensors are sent in native byte order; the wire format is little-endian
    raise ImportError("peer.p2p.wire supports little-endian hosts only")

__all__ = [
    "ALIGNMENT",
    "Compression",
    "Compressed",
    "DEFAULT_LIMITS",
    "HEADER_BYTES",
    "LimitExceeded",
    "Limits",
    "MalformedTensor",
    "TENSOR_EXT_CODE",
    "WireError",
    "check_message_size",
    "compressed",
    "data_nbytes",
    "decode",
    "default_density",
    "set_default_density",
    "topk_params",
    "roundtrip",
    "encode",
    "encode_bytes",
    "parts_nbytes",
]

TENSOR_EXT_CODE = 1
"""msgpack extension type code of a tensor."""
ALIGNMENT = 64
"""Every tensor buffer starts at a multiple of this many bytes from the message start (cache-line / SIMD friendly)."""
HEADER_BYTES = 4
"""Size of the little-endian u32 body length that starts every message."""

_MAX_NDIM = 64  # torch's own limit on tensor dimensions
_MAX_EXT_LEN = 4096  # a tensor header is a few hundred bytes at most (64 dims * 9 bytes + small fields)
_FLOAT16_MAX = 65504.0
_U32 = struct.Struct("<I")
_ZEROS = bytes(ALIGNMENT)
_JOIN_BELOW = 1 << 16  # bodies up to this size are joined with their header into one part


class WireError(Exception):
    """A message could not be encoded or decoded: unsupported object, malformed or hostile bytes."""


class LimitExceeded(WireError):
    """A message (or its length prefix) exceeds one of the :class:`Limits`; detected before allocating for it."""


class MalformedTensor(WireError):
    """A tensor in a received message breaks the format: its header (dtype, shape, codec, offset, length, codec
    parameters) or its bytes (scales, packed codes, indices) are not what the codec can produce. Raised by
    :func:`decode` before any tensor of that message is handed out; the RPC layer answers the call (or fails the
    reply) it came in with a typed error and keeps the connection, like any other :class:`WireError`."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Upper bounds a decoder enforces on what a peer sends, so one message cannot exhaust our memory.

    max_message_bytes: whole message (length prefix + body + tensor buffers); also what the RPC framing layer checks
        on a length prefix via :func:`check_message_size` before it reads the frame.
    max_tensor_elements: elements of one tensor (checked from its header, before its data is touched).
    max_depth: nesting of lists/dicts (the top-level container counts as depth 1).
    max_str_len: bytes of one UTF-8 string.   max_bin_len: bytes of one ``bytes`` value.
    max_container_len: items of one list or entries of one dict.
    max_decoded_bytes: bytes of all the tensors decoded from one message together (elements times their dtype's
        size, checked from each tensor's header before that tensor is made).

    Decoded tensors can take more memory than the message: up to 4x for the float16 codec and 8x for the 8-bit
    codec (both decoding to float64; the blockwise INT8 codec decodes to the original dtype), 16x and 32x for
    INT4 and INT2 decoding to float64, and far more for the top-k codecs (a chunk of 65536 elements keeping one
    costs 13 bytes): hence max_decoded_bytes, whose default still admits the 8-bit codec's worst case on a
    message of max_message_bytes. Uncompressed tensors decoded from a writable buffer take none.
    """

    max_message_bytes: int = 1 << 30
    max_tensor_elements: int = 1 << 28
    max_depth: int = 32
    max_str_len: int = 1 << 20
    max_bin_len: int = 1 << 30
    max_container_len: int = 1_000_000
    max_decoded_bytes: int = 1 << 33


DEFAULT_LIMITS = Limits()


class Compression(IntEnum):
    """Lossy codecs for floating-point tensors (float32, float64, float16, bfloat16); other dtypes travel as-is.

    NONE: exact.
    FLOAT16: values are rounded to float16 (round to nearest even). Finite values beyond +-65504 are clamped to
        +-65504; infinities and NaN are kept. For |x| <= 65504 the error is
        ``|x - x'| <= max(|x| * 2**-11, 2**-25)`` for float32 input (2**-11 relative in float16's normal range,
        2**-25 absolute among its subnormals). float64 input is converted through float32 by torch, which adds
        at most ``|x| * 2**-24``. float16 and bfloat16 tensors are sent unchanged (no size gain; bfloat16 would
        lose range).
    UINT8: 8-bit uniform quantization over [min, max] of the tensor: q = round((x - min) / scale) with
        scale = (max - min) / 255, decoded as min + q * scale. Error per element:
        ``|x - x'| <= (max - min) / 510 + 4 * eps * max(|min|, |max|)`` where eps = torch.finfo(dtype).eps
        (the second term is float rounding in the tensor's own dtype). A constant tensor is exact. A tensor holding
        NaN or infinity, or whose range overflows float64, is sent uncompressed (8 bits cannot represent it).

    INT8: blockwise symmetric 8-bit quantization, for pseudo-gradients and other values whose magnitude varies
        across a tensor (one min/max for the whole tensor, as UINT8 does, lets a few large values wipe out the
        small ones). The flattened tensor is cut into blocks of ``INT8_BLOCK`` (256) elements; each block has its
        own scale ``s = 2**ceil(log2(max|block| / 127))`` (a power of two, sent as float32) and its values are sent
        as ``q = round(x / s)`` in [-127, 127], decoded as ``q * s``. Error per element, for float32 and float64
        input: ``|x - x'| <= s / 2 <= max|block| / 127``; a block of zeros is exact; a value whose block's scale is
        below float32's smallest subnormal (max|block| < 127 * 2**-149) decodes to 0. Power-of-two scales make the
        division and the decoding exact and the codec idempotent on its own output for the same blocks
        (``roundtrip(roundtrip(x)) == roundtrip(x)``), which lets every member of an all-reduce hold bit-identical
        values. Size: 1 + 4/256 bytes per element. A tensor holding NaN or infinity, or whose block maximum
        exceeds float32's range, is sent uncompressed. float16 and bfloat16 tensors decode clamped to their
        finite range (a scale rounded up could put 65504 at 64 * 1024, which float16 rounds to infinity).

    The codecs below are for pseudo-gradients at the frontier of compression (DiLoCo's outer gradients, with error
    feedback: `averaging.outer_state.ErrorFeedback`). All of them: deterministic (the same bytes in every process
    for the same input and parameters, on a given torch build and CPU), idempotent on their own output
    (``roundtrip(roundtrip(x)) == roundtrip(x)``, which lets every member of an all-reduce or all-gather hold
    bit-identical values), decoded exactly from the bytes (no state on the receiver); a tensor holding NaN or
    infinity, or a value beyond float32's range, is sent uncompressed. The bounds are for float32 and float64
    input; float16 and bfloat16 tensors decode back to their dtype (rounded, and clamped to its finite range).
    "+ rounding" below is the float rounding of the quantizer's arithmetic in the working precision (float64 for
    float64 input, float32 otherwise): a few units in the last place of the block's largest magnitude.

    INT4: blockwise symmetric 4-bit quantization: blocks of ``INT4_BLOCK`` (64) elements, each with a float32
        scale s, ``q = round(x / s)`` in [-7, 7] sent as 4-bit two's complement (code -8 is invalid), two per
        byte (element 2i in the low nibble of byte i), decoded as ``q * s``. The scale has 5 significant bits:
        the smallest ``m * 2**e >= max|block| / 7`` with ``16 <= m < 32`` (at least 2**-126). A power of two,
        as INT8 uses, would waste up to half the range (one of the 4 bits); 5 bits waste at most 1/16 of it,
        keep ``q * s`` exact in float32 and bfloat16 (3 bits times 5 bits), and keep the codec idempotent (the
        decoded block's maximum is exactly ``7 * s``, whose scale is s again). Error per element:
        ``|x - x'| <= s / 2 < max|block| * 17 / 224`` (+ rounding); zeros are exact. Size: 1/2 + 4/64 bytes per
        element; params ``[block]``; the buffer holds the blocks' float32 scales, then the packed codes.
    INT2: blockwise 2-bit quantization, sign and magnitude: blocks of ``INT2_BLOCK`` (128) elements, each with two
        float32 magnitude levels ``a <= b``; an element is sent as its sign (bit 1 of its code: negative) and
        whether its magnitude is nearer b than a (bit 0; ties to b), four codes per byte (element 4i in the low
        bits of byte i), decoded as ``+-a`` or ``+-b``. The levels are one Lloyd (2-means) step from the block's
        extremes lo = min|x| and hi = max|x|: the mean magnitude of the elements nearer lo, and of those nearer
        hi (see `_two_levels`). Error per element: ``|x - x'| <= (hi - lo) / 2`` (+ rounding), since a is at
        most and b at least the midpoint; and over a block the squared error is at most that of sending each
        element as the nearer of lo and hi (a Lloyd step never increases it), which is at most
        ``||block||**2 - hi**2``: the codec is a contraction, as error feedback needs. Why not one scale with
        symmetric levels: on heavy-tailed pseudo-gradients (benchmarks/bench_codecs.py) the levels
        ``+-s/2, +-3s/2`` with s from the block maximum give a relative L2 error of 1.23 at blocks of 64 (every
        small value becomes +-s/2: worse than sending nothing), ``-s, 0, s`` give 0.69; two levels per block of
        128 give 0.47 for the same 2.5 bits per element. Size: 1/4 + 8/128 bytes per element; params
        ``[block]``; the buffer holds the blocks' (a, b) pairs, then the packed codes.

    TOPK2, TOPK8: sparse top-k (SparseLoCo's setting with TOPK2): the flattened tensor is cut into chunks of
        ``chunk`` elements (``TOPK_CHUNK``, 4096, or the whole tensor when smaller; the last chunk may be
        shorter); each full chunk keeps the k elements of largest magnitude (``k = ceil(density * chunk)``, the
        density being the tensor's own or :func:`default_density`, see :func:`topk_params`), a last chunk of
        n < chunk elements keeps ``ceil(k * n / chunk)``. Ties are broken by the lower index, so the kept set is
        a function of the values alone. Every element not kept decodes to exactly 0. params ``[chunk, k]`` with
        ``1 <= k <= chunk <= 65536``: the receiver reads them from the header, never from its own configuration.
        The buffer holds, in order: the chunks' float32 scales, the kept elements' indices inside their chunk
        (strictly increasing within a chunk; Elias-Fano coded, see `_elias_fano`: for the full chunks, then for
        the shorter last one, the chunks' high bit vectors one after the other, then every index's low bits,
        each of the two byte-aligned), then their values:
        - TOPK2: 2 bits per kept element, INT2's sign-and-magnitude code and levels on the chunk's kept values
          (two float32 levels a <= b per chunk; lo and hi are the smallest and largest kept magnitude), four per
          byte. Error per kept element: ``|x - x'| <= (hi - lo) / 2`` (+ rounding), a chunk's squared error on
          its kept values at most ``||kept||**2 - hi**2``. (Measured on heavy-tailed pseudo-gradients at 2%: the
          kept values' relative L2 error is 0.27, against 0.80 for symmetric levels from the chunk maximum.) A
          kept zero (a chunk with fewer than k non-zeros) may decode to +a.
        - TOPK8: one int8 per kept element in [-127, 127], with a power-of-two scale per chunk as INT8's (from
          the largest kept magnitude): ``|x - x'| <= s / 2 <= hi / 127``, and ``<= |x|``.
        Size: per chunk 8 (TOPK2) or 4 (TOPK8) bytes of scales, per kept element about ``2 + log2(1 /
        density)`` bits of index (7.6 at 2%) plus 2 or 8 bits of value: about 1/154 (TOPK2) and 1/100 (TOPK8)
        of float32 at the default 2%.
    """

    NONE = 0
    FLOAT16 = 1
    UINT8 = 2
    INT8 = 3
    INT4 = 4
    INT2 = 5
    TOPK2 = 6
    TOPK8 = 7


INT8_BLOCK = 256
"""Elements per block of the blockwise INT8 codec (one float32 scale per block)."""
INT4_BLOCK = 64
"""Elements per block of the INT4 codec: the scale costs 1/2 bit per element (an eighth of the 4-bit codes).
Measured on pseudo-gradients (benchmarks/bench_codecs.py --blocks), relative L2 error / bits per element: blocks
of 32: 0.148 / 5, 64: 0.185 / 4.5, 128: 0.228 / 4.25, 256: 0.280 / 4.125: from 64, blocks of 32 would cut the
error by a fifth for 11% more bytes, blocks of 128 save 6% of the bytes for 23% more error."""
INT2_BLOCK = 128
"""Elements per block of the INT2 codec: its two levels cost 1/2 bit per element. Measured as INT4_BLOCK: 32:
0.365 / 4 bits, 64: 0.417 / 3, 128: 0.466 / 2.5, 256: 0.514 / 2.25: at 64 the levels would cost half as much
as the codes themselves (20% more bytes for 11% less error); 256 saves 10% of the bytes for 10% more error."""
TOPK_CHUNK = 4096
"""Elements per chunk of the top-k codecs: a chunk's scales cost 1/64 bit (TOPK8: 1/128) per element, and a
chunk still spreads what is kept over the whole tensor. (An index's cost depends on the density, not the chunk.)"""
TOPK_DENSITY = 0.02
"""The default fraction of each chunk the top-k codecs keep (see :func:`default_density`)."""
_TOPK = (Compression.TOPK2, Compression.TOPK8)
_MAX_CHUNK = 1 << 16  # chunk-local indices fit in uint16
_MAX_BLOCK = 1 << 20
_density = TOPK_DENSITY


def default_density() -> float:
    """The fraction of each chunk the top-k codecs keep for a tensor that does not carry its own (``compressed(t,
    codec, density=...)``): ``TOPK_DENSITY`` unless :func:`set_default_density` changed it. The receiver needs no
    setting: the number kept travels in each tensor's header."""
    return _density


def set_default_density(density: float) -> None:
    """Set the process-wide default density of the top-k codecs (e.g. from a ``--density`` option): ``0 <
    density <= 1``. Only what this process sends changes; tensors marked with their own density keep it."""
    global _density
    _density = _check_density(density)


def _check_density(density: object) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
        raise WireError(f"top-k density must be a number in (0, 1], got {density!r}")
    return float(density)


def topk_params(numel: int, density: float | None = None) -> tuple[int, int]:
    """``(chunk, k)`` of a tensor of ``numel`` elements sent with a top-k codec at ``density`` (default:
    :func:`default_density`): what its header carries."""
    density = _density if density is None else _check_density(density)
    chunk = max(1, min(TOPK_CHUNK, numel))
    return chunk, max(1, min(chunk, math.ceil(density * chunk)))


# torch is imported on first use, not with this module: `peer status` and the DHT speak this codec without ever
# handling a tensor, and importing torch is most of their start-up time (about 1 s idle, 6 s on a busy machine).
# No message can hold a tensor before torch is imported: a sender made it, or a decoded tensor header imports it.
_FLOATING: tuple[torch.dtype, ...] = ()
# The one table of dtypes that may cross the wire (tensors, expert schemas, averaged state): name -> dtype, names
# being `str(dtype)` without the "torch." prefix. Filled when torch is first needed: use `dtype_name` and
# `dtype_from_name`, which load it.
_TABLE: dict[str, torch.dtype] = {}


class _DtypeTable(Mapping[str, "torch.dtype"]):
    """`DTYPES`: a read-only mapping that imports torch the first time anyone reads it, so code that reads the
    table never sees it empty (the codec itself checks `_TABLE` to stay torch-free until a tensor appears)."""

    def _loaded(self) -> dict[str, torch.dtype]:
        if not _TABLE:
            _load_torch()
        return _TABLE

    def __getitem__(self, name: str) -> torch.dtype:
        return self._loaded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())


DTYPES: Mapping[str, torch.dtype] = _DtypeTable()
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_ITEMSIZE: dict[torch.dtype, int] = {}


def _load_torch() -> None:
    """Import torch and build the dtype tables (and let tensors pass the decoded-message type check)."""
    global torch, _FLOATING, _PLAIN_TYPES, _ALLOWED_TYPES
    import torch

    _FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    names = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
             "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
             "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}
    _ITEMSIZE.update({dtype: torch.empty((), dtype=dtype).element_size() for dtype in names.values()})
    _DTYPE_NAMES.update({dtype: name for name, dtype in names.items()})
    _PLAIN_TYPES = _PLAIN_TYPES | {torch.Tensor}
    _ALLOWED_TYPES = _PLAIN_TYPES | _CONTAINER_TYPES
    _TABLE.update(names)  # last: a non-empty _TABLE means everything above is in place


def dtype_name(dtype: torch.dtype) -> str | None:
    """The wire name of `dtype`, or None when it cannot be sent."""
    if not _TABLE:
        _load_torch()
    return _DTYPE_NAMES.get(dtype)


def dtype_from_name(name: object) -> torch.dtype | None:
    """The dtype a wire name stands for, or None for an unknown name (or a non-string from a hostile peer)."""
    if not _TABLE:
        _load_torch()
    return _TABLE.get(name) if type(name) is str else None


@dataclasses.dataclass(frozen=True)
class Compressed:
    """A tensor marked with the codec it must be sent with, overriding ``encode(..., compression=...)``, and for
    the top-k codecs the fraction kept (None: :func:`default_density`)."""

    tensor: torch.Tensor
    compression: Compression
    density: float | None = None


def compressed(tensor: torch.Tensor, compression: Compression, *, density: float | None = None) -> Compressed:
    """Mark one tensor to be sent with ``compression`` (decoded back as a tensor of its original dtype);
    ``density`` (0 < density <= 1) is the fraction the top-k codecs keep, ignored by the other codecs."""
    if not _TABLE:
        _load_torch()
    if not isinstance(tensor, torch.Tensor):
        raise WireError(f"compressed() expects a torch.Tensor, got {type(tensor).__name__}")
    try:
        compression = Compression(compression)
    except ValueError as exc:
        raise WireError(f"unknown compression {compression!r}") from exc
    return Compressed(tensor, compression, None if density is None else _check_density(density))


def check_message_size(n: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse a message length (e.g. from a frame's length prefix) before any buffer is allocated for it."""
    if n < HEADER_BYTES:
        raise WireError(f"message of {n} bytes is shorter than its {HEADER_BYTES}-byte header")
    if n > limits.max_message_bytes:
        raise LimitExceeded(f"message of {n} bytes exceeds max_message_bytes={limits.max_message_bytes}")


def parts_nbytes(parts: list[bytes | memoryview]) -> int:
    """Total length of a message given as the parts :func:`encode` returned."""
    return sum(part.nbytes if isinstance(part, memoryview) else len(part) for part in parts)


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


# ----------------------------------------------------------------------------------------------------------- encode


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a flat memoryview over its storage (no copy)."""
    flat = tensor.reshape(-1)
    if flat.stride(0) != 1:  # one element counts as contiguous with any stride (e.g. `x[::2]` of 2 elements)
        flat = flat.as_strided((flat.numel(),), (1,))
    flat = flat.view(torch.uint8)  # uint8 view: works for bfloat16/bool, which numpy lacks
    return memoryview(flat.numpy())  # type: ignore[arg-type]  # numpy arrays export the buffer protocol


def _quantize_uint8(tensor: torch.Tensor) -> tuple[torch.Tensor, list[float]] | None:
    """8-bit uniform quantization over [min, max]; None when the values cannot be represented (NaN, inf)."""
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8), [0.0, 0.0]
    lo_t, hi_t = torch.aminmax(tensor)
    lo, hi = float(lo_t), float(hi_t)
    if not (math.isfinite(lo) and math.isfinite(hi)):  # aminmax propagates NaN, so this also catches NaN
        return None
    span = hi - lo
    if not math.isfinite(span):
        return None
    scale = span / 255.0
    if not math.isfinite(lo + 255.0 * scale):  # the decoder's top value: 255 * (span / 255) may round past max
        return None
    if scale == 0.0:
        return torch.zeros(tensor.numel(), dtype=torch.uint8), [lo, 0.0]
    # float32 arithmetic is enough (and half the memory traffic) unless the range or the step leaves its
    # comfortable normal range; float64 tensors are always quantized in float64.
    wide = tensor.dtype == torch.float64 or span > 1e37 or scale < 1e-30
    work = tensor.to(torch.float64 if wide else torch.float32)
    if work is tensor:
        work = tensor - lo
    else:
        work.sub_(lo)
    q = work.div_(scale).round_().clamp_(0, 255).to(torch.uint8)
    return q.reshape(-1), [lo, scale]


def _quantize_int8_blocks(tensor: torch.Tensor, block: int) -> torch.Tensor | None:
    """Blockwise 8-bit quantization (see Compression.INT8): one uint8 buffer holding the float32 scales of the
    blocks, then the int8 values; None when the values cannot be represented (NaN, inf, beyond float32)."""
    flat = tensor.reshape(-1)
    numel = flat.numel()
    nblocks = -(-numel // block)
    wide = tensor.dtype == torch.float64
    work = flat.to(torch.float64 if wide else torch.float32)
    padded = torch.nn.functional.pad(work, (0, nblocks * block - numel)).view(nblocks, block)
    absmax = padded.abs().amax(dim=1).to(torch.float64)
    if not bool(torch.isfinite(absmax).all()) or (numel and float(absmax.max()) > 3.0e38):
        return None
    scales = _pow2_scales(absmax, 127.0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).to(work.dtype)
    q = padded.div(safe.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8).reshape(-1)[:numel]
    out = torch.empty(nblocks * 4 + numel, dtype=torch.uint8)
    out[: nblocks * 4].view(torch.float32).copy_(scales.to(torch.float32))
    out[nblocks * 4:].view(torch.int8).copy_(q)
    return out


def _int8_nbytes(numel: int, block: int) -> int:
    return -(-numel // block) * 4 + numel


def _dequantize_int8_blocks(raw: torch.Tensor, numel: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    nblocks = -(-numel // block)
    scales = raw[: nblocks * 4].view(torch.float32)
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise WireError("malformed 8-bit block scales")
    q = raw[nblocks * 4:].view(torch.int8)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    values = torch.nn.functional.pad(q.to(work), (0, nblocks * block - numel)).view(nblocks, block)
    return _to_dtype(values.mul_(scales.to(work).unsqueeze(1)).reshape(-1)[:numel], dtype)


# --------------------------------------------------------------------- INT4, INT2 and the top-k codecs (encode)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a codec computes in: float64 for float64 tensors, float32 for the others."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pow2_scales(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """INT8's scales: the smallest power of two >= absmax / top (at least 2**-149; 0 where absmax is 0)."""
    mantissa, exponent = torch.frexp(absmax / top)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp_(min=-149)
    return torch.where(absmax > 0, torch.ldexp(torch.ones_like(absmax), exponent), torch.zeros_like(absmax))


def _grid_scales(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """INT4's and INT2's scales (float64): the smallest ``m * 2**e >= absmax / top`` with ``16 <= m < 32``, at
    least 2**-126; 0 where absmax is 0. ``top * s`` gives back s exactly, which makes the codecs idempotent."""
    mantissa, exponent = torch.frexp(absmax / top)
    scales = torch.ldexp(torch.ceil(mantissa * 32), exponent - 5).clamp_(min=2.0**-126)
    return torch.where(absmax > 0, scales, torch.zeros_like(scales))


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `bits` bits packed 8 // bits to a byte, the first in the low bits; the padding is zeros."""
    per = 8 // bits
    if codes.numel() % per:
        codes = torch.cat([codes, codes.new_zeros(per - codes.numel() % per)])
    groups = codes.view(-1, per)
    packed = groups[:, 0].clone()
    for position in range(1, per):  # over the codes of a byte (1 or 3), not over elements
        packed |= groups[:, position] << (bits * position)
    return packed


def _unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The `count` codes of `packed` (inverse of _pack_codes); padding bits that are not zero are malformed."""
    per, mask = 8 // bits, (1 << bits) - 1
    codes = torch.stack([(packed >> (bits * position)) & mask for position in range(per)], dim=1).view(-1)
    if bool(codes[count:].any()):
        raise MalformedTensor("packed codes: padding bits are not zero")
    return codes[:count]


def _rows(numel: int, length: int) -> list[tuple[int, int, int]]:
    """(first row, rows, elements per row) of a flat tensor cut into rows of `length`: the full rows, then a
    shorter last one."""
    full, last = divmod(numel, length)
    return ([(0, full, length)] if full else []) + ([(full, 1, last)] if last else [])


def _topk_parts(numel: int, chunk: int, k: int) -> list[tuple[int, int, int, int]]:
    """(first chunk, chunks, elements per chunk, kept per chunk) of the full chunks and of a shorter last one."""
    return [(first, rows, length, -(-k * length // chunk)) for first, rows, length in _rows(numel, chunk)]


def _int4_nbytes(numel: int, block: int) -> int:
    return -(-numel // block) * 4 + (numel + 1) // 2


def _int2_nbytes(numel: int, block: int) -> int:
    return -(-numel // block) * 8 + (numel + 3) // 4


def _topk_nbytes(numel: int, chunk: int, k: int, codec: Compression) -> int:
    parts = _topk_parts(numel, chunk, k)
    chunks = sum(rows for _, rows, _, _ in parts)
    kept = sum(rows * kk for _, rows, _, kk in parts)
    index_bytes = sum(sum(_indices_nbytes(rows, length, kk)) for _, rows, length, kk in parts)
    if codec == Compression.TOPK2:
        return chunks * 8 + index_bytes + (kept + 3) // 4
    return chunks * 4 + index_bytes + kept


def _representable(magnitude_max: torch.Tensor) -> bool:
    """Whether the largest magnitudes of some rows can be sent by a quantizing codec: finite, within float32."""
    return bool(torch.isfinite(magnitude_max).all()) and float(magnitude_max.max()) <= 3.0e38


def _quantize_int4(tensor: torch.Tensor, block: int) -> torch.Tensor | None:
    """INT4 (see Compression): one uint8 buffer holding the float32 scales of the blocks, then the packed codes;
    None when the values cannot be represented (NaN, inf, beyond float32)."""
    flat = tensor.reshape(-1)
    numel = flat.numel()
    if numel == 0:
        return torch.empty(0, dtype=torch.uint8)
    nblocks = -(-numel // block)
    work = flat.to(_work_dtype(tensor.dtype))
    padded = torch.nn.functional.pad(work, (0, nblocks * block - numel)).view(nblocks, block)
    absmax = padded.abs().amax(dim=1).to(torch.float64)
    if not _representable(absmax):
        return None
    scales = _grid_scales(absmax, 7.0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).to(work.dtype).unsqueeze(1)
    # q in [-7, 7] as 4-bit two's complement (padded is a new tensor: divided in place)
    codes = padded.div_(safe).round_().clamp_(-7, 7).to(torch.int8).view(torch.uint8) & 0xF
    packed = _pack_codes(codes.reshape(-1)[:numel], 4)
    out = torch.empty(nblocks * 4 + packed.numel(), dtype=torch.uint8)
    out[: nblocks * 4].view(torch.float32).copy_(scales.to(torch.float32))
    out[nblocks * 4:].copy_(packed)
    return out


def _two_levels(magnitude: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The magnitude levels of INT2 and TOPK2 for rows of magnitudes (float32 or float64): one Lloyd (2-means)
    step from the row's extremes. With lo and hi the smallest and largest magnitude of a row, the elements nearer
    hi (ties included) and the others form two groups; the levels are their mean magnitudes (float64 sums, exact
    when a group's values are equal, which makes the codecs idempotent; lo or hi for an empty group), rounded to
    float32. Returns (lower levels, upper levels) as float32 per row and, per element, whether it is sent as the
    upper level: the nearer of the two (ties to the upper one)."""
    lo = magnitude.amin(dim=1, keepdim=True)
    hi = magnitude.amax(dim=1, keepdim=True)
    upper = (magnitude - lo) >= (hi - magnitude)
    count_upper = upper.sum(dim=1, keepdim=True)
    count_lower = magnitude.shape[1] - count_upper
    zero = torch.zeros((), dtype=magnitude.dtype)
    sum_upper = torch.where(upper, magnitude, zero).sum(dim=1, keepdim=True, dtype=torch.float64)
    sum_lower = torch.where(upper, zero, magnitude).sum(dim=1, keepdim=True, dtype=torch.float64)
    hi32 = torch.where(count_upper > 0, sum_upper / count_upper.clamp(min=1), hi.double()).to(torch.float32)
    lo32 = torch.where(count_lower > 0, sum_lower / count_lower.clamp(min=1), lo.double()).to(torch.float32)
    lo_w, hi_w = lo32.to(magnitude.dtype), hi32.to(magnitude.dtype)
    return lo32.view(-1), hi32.view(-1), (magnitude - lo_w) >= (hi_w - magnitude)


def _quantize_int2(tensor: torch.Tensor, block: int) -> torch.Tensor | None:
    """INT2 (see Compression): the blocks' (lower, upper) float32 levels, then the packed 2-bit codes; None when
    the values cannot be represented (NaN, inf, beyond float32)."""
    flat = tensor.reshape(-1)
    numel = flat.numel()
    if numel == 0:
        return torch.empty(0, dtype=torch.uint8)
    work = flat.to(_work_dtype(tensor.dtype))
    levels, codes = [], []
    for first, rows, length in _rows(numel, block):  # the full blocks, then a shorter last one (no padding)
        part = work[first * block: first * block + rows * length].view(rows, length)
        magnitude = part.abs()
        if not _representable(magnitude.amax(dim=1)):
            return None
        lo32, hi32, upper = _two_levels(magnitude)
        levels.append(torch.stack([lo32, hi32], dim=1).view(-1))
        codes.append((upper.to(torch.uint8) | ((part < 0).to(torch.uint8) << 1)).view(-1))
    return torch.cat([torch.cat(levels).view(torch.uint8), _pack_codes(torch.cat(codes), 2)])


def _elias_fano(length: int, kept: int) -> tuple[int, int]:
    """(low bits per index, high bits per chunk) of the Elias-Fano code of `kept` increasing indices below
    `length`: each index sends its ``low = floor(log2(length / kept))`` low bits as they are, and the high parts
    go as one bit vector per chunk with a 1 at ``(index >> low) + i`` for the i-th index (``kept + ((length - 1)
    >> low) + 1`` bits). About ``2 + log2(length / kept)`` bits per index: 7.6 at 82 of 4096 (2%), against 12 for
    plain 12-bit indices, within 0.6 bit of the log2 C(4096, 82) / 82 = 7.0 any code needs; and a fixed size for
    given parameters, so the receiver checks the length from the header alone, and decoding is vectorised (the
    positions of the set bits) instead of a sequential walk as gap or Rice codes need."""
    low = (length // kept).bit_length() - 1
    return low, kept + ((length - 1) >> low) + 1


def _indices_nbytes(rows: int, length: int, kept: int) -> tuple[int, int]:
    """Bytes of one part's high bit vectors and of its low bits (each byte-aligned)."""
    low, high = _elias_fano(length, kept)
    return -(-rows * high // 8), -(-rows * kept * low // 8)


def _pack_indices(index: torch.Tensor, length: int) -> torch.Tensor:
    """One part's chunk-local indices (rows x kept, increasing along each row) as bytes: the Elias-Fano high bit
    vectors of every row, then every index's low bits (each packed a bit at a time from the low bit up)."""
    rows, kept = index.shape
    low, high = _elias_fano(length, kept)
    bits = torch.zeros(rows, high, dtype=torch.uint8)
    bits.scatter_(1, (index >> low) + torch.arange(kept), 1)
    packed = [_pack_codes(bits.view(-1), 1)]
    if low:
        lows = ((index.reshape(-1, 1) >> torch.arange(low)) & 1).to(torch.uint8)
        packed.append(_pack_codes(lows.view(-1), 1))
    return torch.cat(packed)


def _unpack_indices(raw: torch.Tensor, rows: int, length: int, kept: int) -> torch.Tensor:
    """The inverse of _pack_indices: rows x kept int64; a row whose high bit vector does not hold exactly `kept`
    set bits, or padding that is not zero, is malformed (the caller checks order and range)."""
    low, high = _elias_fano(length, kept)
    high_nbytes, _ = _indices_nbytes(rows, length, kept)
    bits = _unpack_codes(raw[:high_nbytes], 1, rows * high).view(rows, high)
    if bool((bits.sum(dim=1, dtype=torch.int64) != kept).any()):
        raise MalformedTensor("top-k indices: a chunk's high bit vector does not hold one bit per kept element")
    index = (bits.nonzero()[:, 1].view(rows, kept) - torch.arange(kept)) << low
    if low:
        lows = _unpack_codes(raw[high_nbytes:], 1, rows * kept * low).view(-1, low).to(torch.int64)
        index |= (lows << torch.arange(low)).sum(dim=1).view(rows, kept)
    return index


def _topk_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the k elements of largest magnitude in each row, ties to the lower index.

    torch.topk picks k + 1 (on the magnitudes' bit patterns, which order like the magnitudes, NaN and infinity
    above all finite values): a row whose (k+1)-th is smaller than its k-th has exactly one top-k set, which
    any implementation finds; the rows where they tie take a stable sort instead (rare for real values)."""
    count, length = rows.shape
    if k >= length:
        return torch.arange(length).expand(count, length)
    bits = rows.abs().view(torch.int64 if rows.dtype == torch.float64 else torch.int32)
    top = torch.topk(bits, k + 1, dim=1, sorted=False)
    at_floor = top.values == top.values.amin(dim=1, keepdim=True)
    tied = at_floor.sum(dim=1) > 1
    if not bool(tied.any()):
        chosen = top.indices[~at_floor].view(count, k)
    else:
        clear = ~tied
        chosen = torch.empty(count, k, dtype=torch.int64)
        chosen[clear] = top.indices[clear][~at_floor[clear]].view(-1, k)
        chosen[tied] = torch.sort(bits[tied], dim=1, descending=True, stable=True).indices[:, :k]
    return chosen.to(torch.int32).sort(dim=1).values.to(torch.int64)  # an int32 sort is 5x faster


def _encode_topk(tensor: torch.Tensor, codec: Compression, chunk: int, k: int) -> torch.Tensor | None:
    """TOPK2 / TOPK8 (see Compression): scales, indices, values in one uint8 buffer; None when the values cannot
    be represented (NaN, inf, beyond float32)."""
    flat = tensor.reshape(-1)
    numel = flat.numel()
    if numel == 0:
        return torch.empty(0, dtype=torch.uint8)
    work = flat.to(_work_dtype(tensor.dtype))
    scales, indices, values = [], [], []
    for first, rows, length, kept in _topk_parts(numel, chunk, k):  # the full chunks, then a shorter last one
        part = work[first * chunk: first * chunk + rows * length].view(rows, length)
        index = _topk_rows(part, kept)
        value = part.gather(1, index)
        magnitude = value.abs()
        hi = magnitude.amax(dim=1)
        if not _representable(hi):  # the largest magnitudes (NaN and infinity too) are among those kept
            return None
        if codec == Compression.TOPK2:
            lo32, hi32, upper = _two_levels(magnitude)
            scales.append(torch.stack([lo32, hi32], dim=1).view(-1))
            values.append((upper.to(torch.uint8) | ((value < 0).to(torch.uint8) << 1)).view(-1))
        else:
            scale = _pow2_scales(hi.to(torch.float64), 127.0)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(work.dtype).unsqueeze(1)
            values.append(value.div_(safe).round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8).view(-1))
            scales.append(scale.to(torch.float32))
        indices.append(_pack_indices(index, length))
    scale_bytes = torch.cat(scales).view(torch.uint8)
    index_bytes = torch.cat(indices)
    value_bytes = torch.cat(values)
    if codec == Compression.TOPK2:
        value_bytes = _pack_codes(value_bytes, 2)
    return torch.cat([scale_bytes, index_bytes, value_bytes])


# --------------------------------------------------------------------- INT4, INT2 and the top-k codecs (decode)


def _to_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decoded values (float32 / float64) in the tensor's dtype; float16 and bfloat16 clamped to their finite range
    (a scale rounded up may put a block's top level just past it)."""
    if dtype in (torch.float16, torch.bfloat16):
        limit = torch.finfo(dtype).max
        values = values.clamp_(-limit, limit)
    return values.to(dtype)


def _check_scales(scales: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise MalformedTensor(f"{what}: scales must be finite and non-negative")


def _dequantize_int4(raw: torch.Tensor, numel: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    nblocks = -(-numel // block)
    scales = raw[: nblocks * 4].view(torch.float32)
    _check_scales(scales, "INT4")
    codes = _unpack_codes(raw[nblocks * 4:], 4, numel)
    if bool((codes == 8).any()):
        raise MalformedTensor("INT4: code -8 is not a level")
    work = _work_dtype(dtype)
    levels = ((codes.view(torch.int8) ^ 8) - 8).to(work)
    padded = torch.nn.functional.pad(levels, (0, nblocks * block - numel)).view(nblocks, block)
    return _to_dtype(padded.mul_(scales.to(work).unsqueeze(1)).view(-1)[:numel], dtype)


def _check_levels(levels: torch.Tensor, what: str) -> None:
    """(lower, upper) float32 magnitude levels per row: finite, non-negative, lower <= upper."""
    _check_scales(levels, what)
    if bool((levels[:, 0] > levels[:, 1]).any()):
        raise MalformedTensor(f"{what}: a lower magnitude level is above its upper one")


def _two_level_values(codes: torch.Tensor, levels: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """Values of 2-bit codes (bit 0: upper level, bit 1: negative) on rows whose (lower, upper) levels are given."""
    levels = levels.to(work)
    table = torch.cat([levels, -levels], dim=1)  # per row: a, b, -a, -b, indexed by the code
    return table.gather(1, codes.to(torch.int64))


def _dequantize_int2(raw: torch.Tensor, numel: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    nblocks = -(-numel // block)
    levels = raw[: nblocks * 8].view(torch.float32).view(nblocks, 2)
    _check_levels(levels, "INT2")
    codes = _unpack_codes(raw[nblocks * 8:], 2, numel)
    codes = torch.nn.functional.pad(codes, (0, nblocks * block - numel)).view(nblocks, block)
    return _to_dtype(_two_level_values(codes, levels, _work_dtype(dtype)).view(-1)[:numel], dtype)


def _decode_topk(raw: torch.Tensor, numel: int, chunk: int, k: int, codec: Compression,
                 dtype: torch.dtype) -> torch.Tensor:
    parts = _topk_parts(numel, chunk, k)
    chunks = sum(rows for _, rows, _, _ in parts)
    kept = sum(rows * kk for _, rows, _, kk in parts)
    per_chunk = 2 if codec == Compression.TOPK2 else 1
    cursor = chunks * 4 * per_chunk
    scales = raw[:cursor].view(torch.float32).view(chunks, per_chunk)
    if codec == Compression.TOPK2:
        _check_levels(scales, "TOPK2")
    else:
        _check_scales(scales, "TOPK8")
    indices = []
    for _, rows, length, kk in parts:
        index_nbytes = sum(_indices_nbytes(rows, length, kk))
        indices.append(_unpack_indices(raw[cursor: cursor + index_nbytes], rows, length, kk))
        cursor += index_nbytes
    if codec == Compression.TOPK2:
        codes = _unpack_codes(raw[cursor:], 2, kept)
    else:
        codes = raw[cursor:].view(torch.int8)
        if bool((codes == -128).any()):
            raise MalformedTensor("TOPK8: value -128 is not a level")
    work = _work_dtype(dtype)
    out = torch.zeros(numel, dtype=work)
    seen = 0
    for (first, rows, length, kk), index in zip(parts, indices):
        if kk > 1 and not bool((index[:, 1:] > index[:, :-1]).all()):
            raise MalformedTensor(f"{codec.name}: indices of a chunk are not strictly increasing")
        if bool((index[:, -1] >= length).any()):
            raise MalformedTensor(f"{codec.name}: an index is past the end of its chunk")
        code = codes[seen: seen + rows * kk].view(rows, kk)
        scale = scales[first: first + rows]
        if codec == Compression.TOPK2:
            value = _two_level_values(code, scale, work)
        else:
            value = code.to(work).mul_(scale.to(work))
        out[first * chunk: first * chunk + rows * length].view(rows, length).scatter_(1, index, value)
        seen += rows * kk
    return _to_dtype(out, dtype)


def data_nbytes(tensor: torch.Tensor | Compressed, compression: Compression = Compression.NONE, *,
                density: float | None = None) -> int:
    """The bytes of tensor data :func:`encode` sends for ``tensor`` (a :class:`Compressed` one with its own
    codec and density), worked out from its shape and dtype without encoding: what traffic counters add per
    tensor. The one exception is a tensor a quantizing codec cannot represent (NaN, infinity, beyond float32),
    which goes uncompressed but is counted as compressed here (finding out would take a pass over the data)."""
    if isinstance(tensor, Compressed):
        compression, density = tensor.compression, tensor.density
        tensor = tensor.tensor
    if not _TABLE:
        _load_torch()
    numel = tensor.numel()
    if tensor.dtype not in _FLOATING or compression == Compression.NONE:
        return numel * tensor.element_size()
    if compression == Compression.FLOAT16:
        return numel * (tensor.element_size() if tensor.dtype in (torch.float16, torch.bfloat16) else 2)
    if compression == Compression.UINT8:
        return numel
    if compression == Compression.INT8:
        return _int8_nbytes(numel, INT8_BLOCK)
    if compression == Compression.INT4:
        return _int4_nbytes(numel, INT4_BLOCK)
    if compression == Compression.INT2:
        return _int2_nbytes(numel, INT2_BLOCK)
    if compression in _TOPK:
        return _topk_nbytes(numel, *topk_params(numel, density), Compression(compression))
    raise WireError(f"unknown compression {compression!r}")


def _tensor_payload(
    tensor: torch.Tensor, compression: Compression, cursor: int, density: float | None = None
) -> tuple[bytes, memoryview | None, int]:
    """Pack one tensor's ext header; return (ext payload, its bytes or None if empty, the next cursor)."""
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise WireError(f"dtype {tensor.dtype} cannot be sent (allowed: {', '.join(DTYPES)})")
    if tensor.layout != torch.strided:
        raise WireError(f"only dense (strided) tensors can be sent, got layout {tensor.layout}")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    shape = list(tensor.shape)
    params: list[float] | list[int] = []
    data = tensor
    if tensor.dtype not in _FLOATING:
        compression = Compression.NONE
    if compression == Compression.FLOAT16:
        if tensor.dtype in (torch.float16, torch.bfloat16):
            compression = Compression.NONE
        else:
            data = tensor.clamp(-_FLOAT16_MAX, _FLOAT16_MAX)
            if tensor.numel() and bool(torch.isinf(tensor).any()):
                data = torch.where(torch.isinf(tensor), tensor, data)  # keep infinities infinite
            data = data.to(torch.float16)
    elif compression == Compression.UINT8:
        quantized = _quantize_uint8(tensor)
        if quantized is None:
            compression = Compression.NONE
        else:
            data, params = quantized
    elif compression == Compression.INT8:
        blocks = _quantize_int8_blocks(tensor, INT8_BLOCK) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        if blocks is None:
            compression = Compression.NONE
        else:
            data, params = blocks, [INT8_BLOCK]
    elif compression in (Compression.INT4, Compression.INT2):
        block = INT4_BLOCK if compression == Compression.INT4 else INT2_BLOCK
        packed = _quantize_int4(tensor, block) if compression == Compression.INT4 else _quantize_int2(tensor, block)
        if packed is None:
            compression = Compression.NONE
        else:
            data, params = packed, [block]
    elif compression in _TOPK:
        chunk, k = topk_params(tensor.numel(), density)
        sparse = _encode_topk(tensor, compression, chunk, k)
        if sparse is None:
            compression = Compression.NONE
        else:
            data, params = sparse, [chunk, k]
    if not data.is_contiguous():
        data = data.contiguous()
    nbytes = data.numel() * data.element_size()
    if nbytes:
        offset = _align(cursor)
        view = _byte_view(data)
        cursor = offset + nbytes
    else:
        offset, view = 0, None
    payload = msgpack.packb([name, shape, int(compression), offset, nbytes, params], use_bin_type=True)
    return payload, view, cursor


def encode(obj: Any, *, compression: Compression = Compression.NONE,
           density: float | None = None) -> list[bytes | memoryview]:
    """Encode ``obj`` as a list of parts whose concatenation is the message (see the module docstring).

    Tensor data is not copied: the memoryviews alias the tensors' storage (a non-contiguous tensor is made
    contiguous once; compressed tensors are new buffers), so do not modify the tensors until the parts are sent.
    ``compression`` applies to every floating tensor not wrapped with :func:`compressed` (``density``, the top-k
    codecs' fraction kept, to those tensors too; default :func:`default_density`). Tensors on another
    device are copied to the CPU (they always decode as CPU tensors); autograd history is not sent.
    Raises WireError for objects that cannot be sent (unsupported type or dtype, ints beyond 64 bits, too deep).
    """
    try:
        default_compression = Compression(compression)
    except ValueError as exc:
        raise WireError(f"unknown compression {compression!r}") from exc
    default_density = None if density is None else _check_density(density)
    views: list[memoryview] = []
    offsets: list[int] = []
    cursor = 0

    def default(value: Any) -> msgpack.ExtType:
        nonlocal cursor
        if not _TABLE:
            _load_torch()
        if isinstance(value, Compressed):
            tensor, codec, fraction = value.tensor, value.compression, value.density
        elif isinstance(value, torch.Tensor):
            tensor, codec, fraction = value, default_compression, default_density
        else:
            raise WireError(f"cannot encode objects of type {type(value).__name__}")
        before = cursor
        payload, view, cursor = _tensor_payload(tensor, codec, cursor, fraction)
        if view is not None:
            views.append(view)
            offsets.append(_align(before))
        return msgpack.ExtType(TENSOR_EXT_CODE, payload)

    try:
        body = msgpack.packb(obj, default=default, use_bin_type=True)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise WireError(f"cannot encode message: {exc}") from exc
    if len(body) > 0xFFFFFFFF:
        raise WireError(f"message body of {len(body)} bytes does not fit the 32-bit length prefix")
    head_len = HEADER_BYTES + len(body)
    data_start = _align(head_len) if views else head_len
    padding = _ZEROS[: data_start - head_len]
    if len(body) <= _JOIN_BELOW:  # one small part is cheaper to send than three
        parts: list[bytes | memoryview] = [_U32.pack(len(body)) + body + padding]
    else:  # a big body (large str/bytes values) is not copied again
        parts = [_U32.pack(len(body)), body] + ([padding] if padding else [])
    end = 0
    for offset, view in zip(offsets, views):
        if offset > end:
            parts.append(_ZEROS[: offset - end])
        parts.append(view)
        end = offset + view.nbytes
    return parts


def roundtrip(tensor: torch.Tensor, compression: Compression, *, density: float | None = None) -> torch.Tensor:
    """What a peer decodes when ``tensor`` is sent with ``compression`` (and, for the top-k codecs, ``density``;
    default :func:`default_density`), exactly: the same code path. Used where the sender must hold the same
    values as the receivers (the reducer of an all-reduce part, error feedback)."""
    if Compression(compression) == Compression.NONE:
        return tensor
    decoded: torch.Tensor = decode(bytearray(encode_bytes(compressed(tensor, compression, density=density))))
    return decoded


def encode_bytes(obj: Any, *, compression: Compression = Compression.NONE, density: float | None = None) -> bytes:
    """:func:`encode` joined into one ``bytes`` (one copy of the tensor data)."""
    return b"".join(encode(obj, compression=compression, density=density))


# ----------------------------------------------------------------------------------------------------------- decode

_PLAIN_TYPES = frozenset({type(None), bool, int, float, str, bytes})  # and torch.Tensor, see _load_torch
_CONTAINER_TYPES = frozenset({list, dict})
_ALLOWED_TYPES = _PLAIN_TYPES | _CONTAINER_TYPES
_ALLOWED_KEY_TYPES = frozenset({type(None), bool, int, float, str, bytes})


def _check_tree(obj: Any, max_depth: int) -> None:
    """Check nesting depth and value types level by level (no recursion; C-speed scans of each container)."""
    level = [obj]
    depth = 1 if type(obj) in _CONTAINER_TYPES else 0  # the top-level container is depth 1
    if type(obj) not in _ALLOWED_TYPES:
        raise WireError(f"unsupported value type in message: {type(obj).__name__}")
    while level:
        types: set[type] = set()
        nested: list[Any] = []
        for value in level:
            if type(value) is dict:
                key_kinds = set(map(type, value))
                if not key_kinds <= _ALLOWED_KEY_TYPES:
                    raise WireError(f"unsupported map key type(s): {sorted(k.__name__ for k in key_kinds)}")
                items: Iterable[Any] = value.values()
            elif type(value) is list:
                items = value
            else:
                continue
            kinds = set(map(type, items))
            types |= kinds
            if kinds & _CONTAINER_TYPES:
                nested.extend([item for item in items if type(item) is list or type(item) is dict])
        if not types <= _ALLOWED_TYPES:
            bad = sorted(t.__name__ for t in types - _ALLOWED_TYPES)
            raise WireError(f"unsupported value type(s) in message: {bad}")
        if nested:
            depth += 1
            if depth > max_depth:
                raise LimitExceeded(f"nesting deeper than max_depth={max_depth}")
        level = nested


def _expected_nbytes(codec: Compression, dtype: torch.dtype, numel: int, params: list[Any]) -> int:
    """The exact byte length of a tensor's data given its header, after checking the codec's parameters."""
    if codec == Compression.NONE:
        expected = numel * _ITEMSIZE[dtype]
    elif codec == Compression.FLOAT16:
        expected = numel * 2
    elif codec == Compression.UINT8:
        if len(params) != 2 or not all(type(p) in (int, float) and math.isfinite(p) for p in params):
            raise MalformedTensor(f"malformed 8-bit codec parameters {params!r}")
        if params[1] < 0:
            raise MalformedTensor("negative 8-bit codec scale")
        return numel
    elif codec in (Compression.INT8, Compression.INT4, Compression.INT2):
        if len(params) != 1 or type(params[0]) is not int or not 1 <= params[0] <= _MAX_BLOCK:
            raise MalformedTensor(f"malformed {codec.name} block parameters {params!r}")
        if codec == Compression.INT8:
            return _int8_nbytes(numel, params[0])
        return (_int4_nbytes if codec == Compression.INT4 else _int2_nbytes)(numel, params[0])
    else:  # the top-k codecs: [chunk, k], 1 <= k <= chunk <= 2**16
        if (len(params) != 2 or not all(type(p) is int for p in params)
                or not 1 <= params[1] <= params[0] <= _MAX_CHUNK):
            raise MalformedTensor(f"malformed {codec.name} parameters {params!r} (need [chunk, k])")
        return _topk_nbytes(numel, params[0], params[1], codec)
    if params:
        raise MalformedTensor(f"unexpected codec parameters {params!r}")
    return expected


class _TensorReader:
    """ext_hook for one message: validates each tensor header against the buffer and the limits, then builds it."""

    def __init__(self, view: memoryview, data_start: int, limits: Limits) -> None:
        self.view = view
        self.data_start = data_start
        self.available = max(0, view.nbytes - data_start)
        self.limits = limits
        self.end = 0  # end of the last non-empty buffer, relative to data_start
        self.decoded = 0  # bytes of the tensors decoded so far (their dtypes' sizes, not the wire's)

    def __call__(self, code: int, payload: bytes) -> torch.Tensor:
        if code != TENSOR_EXT_CODE:
            raise WireError(f"unknown msgpack extension type {code}")
        if not _TABLE:
            _load_torch()
        try:
            header = msgpack.unpackb(
                payload,
                raw=False,
                use_list=True,
                max_str_len=64,
                max_bin_len=0,
                max_array_len=_MAX_NDIM,
                max_map_len=0,
                max_ext_len=0,
            )
        except Exception as exc:
            raise MalformedTensor(f"malformed tensor header: {exc}") from exc
        if type(header) is not list or len(header) != 6:
            raise MalformedTensor("malformed tensor header")
        name, shape, codec_id, offset, nbytes, params = header
        dtype = dtype_from_name(name)
        if dtype is None:
            raise MalformedTensor(f"unknown tensor dtype {name!r}")
        if type(shape) is not list or not all(type(d) is int and 0 <= d < 1 << 63 for d in shape):
            raise MalformedTensor(f"malformed tensor shape {shape!r}")
        numel = math.prod(shape)
        if numel > self.limits.max_tensor_elements:
            raise LimitExceeded(
                f"tensor of {numel} elements exceeds max_tensor_elements={self.limits.max_tensor_elements}"
            )
        self.decoded += numel * _ITEMSIZE[dtype]
        if self.decoded > self.limits.max_decoded_bytes:
            raise LimitExceeded(f"the tensors of this message decode to more than max_decoded_bytes="
                                f"{self.limits.max_decoded_bytes}")
        if type(codec_id) is not int or codec_id not in Compression._value2member_map_:
            raise MalformedTensor(f"unknown compression id {codec_id!r}")
        codec = Compression(codec_id)
        if codec != Compression.NONE and dtype not in _FLOATING:
            raise MalformedTensor(f"compression {codec.name} on a {name} tensor")
        if type(params) is not list:
            raise MalformedTensor("malformed tensor codec parameters")
        expected = _expected_nbytes(codec, dtype, numel, params)
        if type(nbytes) is not int or nbytes != expected:
            raise MalformedTensor(f"tensor byte length {nbytes!r} does not match shape {shape} with {codec.name}")
        if type(offset) is not int or offset < 0:
            raise MalformedTensor(f"malformed tensor offset {offset!r}")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if offset % ALIGNMENT or offset < self.end or offset + nbytes > self.available:
            raise MalformedTensor(f"tensor buffer [{offset}, {offset + nbytes}) is misplaced or past the message end")
        self.end = offset + nbytes
        start = self.data_start + offset
        raw: memoryview | bytearray = self.view[start : start + nbytes]
        if isinstance(raw, memoryview) and raw.readonly:
            raw = bytearray(raw)  # the one copy; a writable buffer is used in place
        data = torch.frombuffer(raw, dtype=torch.uint8)
        if codec == Compression.NONE and dtype == torch.bool and bool((data > 1).any()):
            raise MalformedTensor("bool tensor holds bytes other than 0 and 1")
        if codec == Compression.INT8:
            return _dequantize_int8_blocks(data, numel, params[0], dtype).view(shape)
        if codec in (Compression.INT4, Compression.INT2) or codec in _TOPK:
            try:
                if codec == Compression.INT4:
                    return _dequantize_int4(data, numel, params[0], dtype).view(shape)
                if codec == Compression.INT2:
                    return _dequantize_int2(data, numel, params[0], dtype).view(shape)
                return _decode_topk(data, numel, params[0], params[1], codec, dtype).view(shape)
            except MalformedTensor:
                raise
            except (RuntimeError, ValueError, IndexError) as exc:  # a torch op refused what the checks let through
                raise MalformedTensor(f"{codec.name} tensor: {exc}") from exc
        data = data.view(torch.float16 if codec == Compression.FLOAT16 else
                         torch.uint8 if codec == Compression.UINT8 else dtype)
        if codec == Compression.FLOAT16:
            data = data.to(dtype)
        elif codec == Compression.UINT8:
            low, scale = float(params[0]), float(params[1])
            # the same working precision as the encoder chose: in float32, q * scale overflows to inf for a range
            # wider than float32's (e.g. [-3e38, 3e38]) and a step among subnormals loses its precision
            wide = dtype == torch.float64 or scale * 255.0 > 1e37 or 0.0 < scale < 1e-30
            work = torch.float64 if wide else torch.float32
            data = data.to(work).mul_(scale).add_(low).to(dtype)
        return data.view(shape)


_SMALL_MESSAGE = 64 * 1024


def message_buffer(size: int) -> bytearray | memoryview:
    """A writable buffer for a message of `size` bytes that is about to be received in full.

    `bytearray(size)` zero-fills, which for a tensor message costs about as much CPU as receiving it (measured:
    an 8 MB bytearray is 1.3-1.9 ms against 0.2-1.0 ms for uninitialised memory). Big messages get an
    uninitialised torch byte buffer instead (still one buffer, aliased by the decoded tensors); its previous
    contents are never visible, because the framing delivers a message only when every byte has arrived."""
    if size <= _SMALL_MESSAGE:
        return bytearray(size)
    if not _TABLE:
        _load_torch()
    return memoryview(torch.empty(size, dtype=torch.uint8).numpy())  # type: ignore[arg-type]  # buffer protocol


def decode(buffer: bytes | bytearray | memoryview, *, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode one whole message (exactly; trailing bytes are an error).

    Uncompressed tensors alias ``buffer`` when it is writable (bytearray, writable memoryview): keep the buffer
    alive and unmodified while they are in use (the tensors hold a reference to it). A read-only buffer (bytes) costs
    one copy per tensor. Lists and tuples come back as lists, bytes subclasses as bytes.
    Raises LimitExceeded when a limit is exceeded, WireError for any other malformed input (never another type).
    """
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise WireError(f"decode() needs a bytes-like object, got {type(buffer).__name__}") from exc
    try:
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
    except (TypeError, ValueError) as exc:
        raise WireError(f"unusable buffer: {exc}") from exc
    total = view.nbytes
    check_message_size(total, limits)
    body_len = _U32.unpack_from(view, 0)[0]
    head_len = HEADER_BYTES + body_len
    if head_len > total:
        raise WireError(f"body length {body_len} runs past the end of a {total}-byte message")
    data_start = _align(head_len)
    reader = _TensorReader(view, data_start, limits)
    try:
        obj = msgpack.unpackb(
            view[HEADER_BYTES:head_len],
            raw=False,
            use_list=True,
            strict_map_key=False,
            ext_hook=reader,
            # msgpack preallocates a list or dict from its header, so the caps also never exceed what the body
            # could hold (every item takes at least one byte, every map entry two).
            max_str_len=min(limits.max_str_len, body_len),
            max_bin_len=min(limits.max_bin_len, body_len),
            max_array_len=min(limits.max_container_len, body_len),
            max_map_len=min(limits.max_container_len, body_len // 2),
            max_ext_len=min(_MAX_EXT_LEN, body_len),
        )
    except WireError:
        raise
    except msgpack.exceptions.StackError as exc:
        raise LimitExceeded(f"nesting deeper than the msgpack parser allows (max_depth={limits.max_depth})") from exc
    except ValueError as exc:
        if "exceeds max_" in str(exc):
            raise LimitExceeded(f"message exceeds a limit: {exc}") from exc
        raise WireError(f"malformed message body: {exc}") from exc
    except Exception as exc:  # msgpack can raise TypeError (unhashable key), UnicodeDecodeError, ...
        raise WireError(f"malformed message body: {type(exc).__name__}: {exc}") from exc
    expected = data_start + reader.end if reader.end else head_len
    if total != expected:
        raise WireError(f"message is {total} bytes but its contents end at byte {expected}")
    _check_tree(obj, limits.max_depth)
    return obj
