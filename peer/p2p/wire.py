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
``Compression.UINT8`` where it is ``[min, scale]`` and ``Compression.INT8`` where it is ``[block]`` (the buffer then
holds one float32 scale per block followed by one int8 per element).

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
    "TENSOR_EXT_CODE",
    "WireError",
    "check_message_size",
    "compressed",
    "data_nbytes",
    "decode",
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


@dataclasses.dataclass(frozen=True)
class Limits:
    """Upper bounds a decoder enforces on what a peer sends, so one message cannot exhaust our memory.

    max_message_bytes: whole message (length prefix + body + tensor buffers); also what the RPC framing layer checks
        on a length prefix via :func:`check_message_size` before it reads the frame.
    max_tensor_elements: elements of one tensor (checked from its header, before its data is touched).
    max_depth: nesting of lists/dicts (the top-level container counts as depth 1).
    max_str_len: bytes of one UTF-8 string.   max_bin_len: bytes of one ``bytes`` value.
    max_container_len: items of one list or entries of one dict.

    Decoded tensors can take more memory than the message: up to 4x for the float16 codec and 8x for the 8-bit
    codec (both decoding to float64; the blockwise INT8 codec decodes to the original dtype); uncompressed
    tensors decoded from a writable buffer take none.
    """

    max_message_bytes: int = 1 << 30
    max_tensor_elements: int = 1 << 28
    max_depth: int = 32
    max_str_len: int = 1 << 20
    max_bin_len: int = 1 << 30
    max_container_len: int = 1_000_000


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
        exceeds float32's range, is sent uncompressed.
    """

    NONE = 0
    FLOAT16 = 1
    UINT8 = 2
    INT8 = 3


INT8_BLOCK = 256
"""Elements per block of the blockwise INT8 codec (one float32 scale per block)."""


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
    """A tensor marked with the codec it must be sent with, overriding ``encode(..., compression=...)``."""

    tensor: torch.Tensor
    compression: Compression


def compressed(tensor: torch.Tensor, compression: Compression) -> Compressed:
    """Mark one tensor to be sent with ``compression`` (decoded back as a tensor of its original dtype)."""
    if not _TABLE:
        _load_torch()
    if not isinstance(tensor, torch.Tensor):
        raise WireError(f"compressed() expects a torch.Tensor, got {type(tensor).__name__}")
    try:
        compression = Compression(compression)
    except ValueError as exc:
        raise WireError(f"unknown compression {compression!r}") from exc
    return Compressed(tensor, compression)


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
    mantissa, exponent = torch.frexp(absmax / 127.0)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent).clamp_(min=-149)
    scales = torch.where(absmax > 0, torch.ldexp(torch.ones_like(absmax), exponent), torch.zeros_like(absmax))
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
    return values.mul_(scales.to(work).unsqueeze(1)).reshape(-1)[:numel].to(dtype)


def data_nbytes(tensor: torch.Tensor | Compressed, compression: Compression = Compression.NONE) -> int:
    """The bytes of tensor data :func:`encode` sends for ``tensor`` (a :class:`Compressed` one with its own
    codec), worked out from its shape and dtype without encoding: what traffic counters add per tensor. The
    one exception is a tensor a quantizing codec cannot represent (NaN, infinity, beyond float32), which goes
    uncompressed but is counted as compressed here (finding out would take a pass over the data)."""
    if isinstance(tensor, Compressed):
        compression = tensor.compression
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
    raise WireError(f"unknown compression {compression!r}")


def _tensor_payload(
    tensor: torch.Tensor, compression: Compression, cursor: int
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
    params: list[float] = []
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


def encode(obj: Any, *, compression: Compression = Compression.NONE) -> list[bytes | memoryview]:
    """Encode ``obj`` as a list of parts whose concatenation is the message (see the module docstring).

    Tensor data is not copied: the memoryviews alias the tensors' storage (a non-contiguous tensor is made
    contiguous once; compressed tensors are new buffers), so do not modify the tensors until the parts are sent.
    ``compression`` applies to every floating tensor not wrapped with :func:`compressed`. Tensors on another
    device are copied to the CPU (they always decode as CPU tensors); autograd history is not sent.
    Raises WireError for objects that cannot be sent (unsupported type or dtype, ints beyond 64 bits, too deep).
    """
    try:
        default_compression = Compression(compression)
    except ValueError as exc:
        raise WireError(f"unknown compression {compression!r}") from exc
    views: list[memoryview] = []
    offsets: list[int] = []
    cursor = 0

    def default(value: Any) -> msgpack.ExtType:
        nonlocal cursor
        if not _TABLE:
            _load_torch()
        if isinstance(value, Compressed):
            tensor, codec = value.tensor, value.compression
        elif isinstance(value, torch.Tensor):
            tensor, codec = value, default_compression
        else:
            raise WireError(f"cannot encode objects of type {type(value).__name__}")
        before = cursor
        payload, view, cursor = _tensor_payload(tensor, codec, cursor)
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


def roundtrip(tensor: torch.Tensor, compression: Compression) -> torch.Tensor:
    """What a peer decodes when ``tensor`` is sent with ``compression`` (exactly: the same code path). Used where
    the sender must hold the same values as the receivers (the reducer of an all-reduce part, error feedback)."""
    if Compression(compression) == Compression.NONE:
        return tensor
    decoded: torch.Tensor = decode(bytearray(encode_bytes(compressed(tensor, compression))))
    return decoded


def encode_bytes(obj: Any, *, compression: Compression = Compression.NONE) -> bytes:
    """:func:`encode` joined into one ``bytes`` (one copy of the tensor data)."""
    return b"".join(encode(obj, compression=compression))


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


class _TensorReader:
    """ext_hook for one message: validates each tensor header against the buffer and the limits, then builds it."""

    def __init__(self, view: memoryview, data_start: int, limits: Limits) -> None:
        self.view = view
        self.data_start = data_start
        self.available = max(0, view.nbytes - data_start)
        self.limits = limits
        self.end = 0  # end of the last non-empty buffer, relative to data_start

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
            raise WireError(f"malformed tensor header: {exc}") from exc
        if type(header) is not list or len(header) != 6:
            raise WireError("malformed tensor header")
        name, shape, codec_id, offset, nbytes, params = header
        dtype = dtype_from_name(name)
        if dtype is None:
            raise WireError(f"unknown tensor dtype {name!r}")
        if type(shape) is not list or not all(type(d) is int and 0 <= d < 1 << 63 for d in shape):
            raise WireError(f"malformed tensor shape {shape!r}")
        numel = math.prod(shape)
        if numel > self.limits.max_tensor_elements:
            raise LimitExceeded(
                f"tensor of {numel} elements exceeds max_tensor_elements={self.limits.max_tensor_elements}"
            )
        if type(codec_id) is not int or codec_id not in Compression._value2member_map_:
            raise WireError(f"unknown compression id {codec_id!r}")
        codec = Compression(codec_id)
        if codec != Compression.NONE and dtype not in _FLOATING:
            raise WireError(f"compression {codec.name} on a {name} tensor")
        stored = {Compression.NONE: dtype, Compression.FLOAT16: torch.float16, Compression.UINT8: torch.uint8,
                  Compression.INT8: torch.uint8}[codec]
        if codec == Compression.INT8:
            if (type(params) is not list or len(params) != 1 or type(params[0]) is not int
                    or not 1 <= params[0] <= 1 << 20):
                raise WireError(f"malformed 8-bit block parameters {params!r}")
            expected = _int8_nbytes(numel, params[0])
        else:
            expected = numel * _ITEMSIZE[stored]
        if type(nbytes) is not int or nbytes != expected:
            raise WireError(f"tensor byte length {nbytes!r} does not match shape {shape} of {stored}")
        if type(params) is not list:
            raise WireError("malformed tensor codec parameters")
        if codec == Compression.UINT8:
            if len(params) != 2 or not all(type(p) in (int, float) and math.isfinite(p) for p in params):
                raise WireError(f"malformed 8-bit codec parameters {params!r}")
            if params[1] < 0:
                raise WireError("negative 8-bit codec scale")
        elif params and codec != Compression.INT8:
            raise WireError(f"unexpected codec parameters {params!r}")
        if type(offset) is not int or offset < 0:
            raise WireError(f"malformed tensor offset {offset!r}")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if offset % ALIGNMENT or offset < self.end or offset + nbytes > self.available:
            raise WireError(f"tensor buffer [{offset}, {offset + nbytes}) is misplaced or past the message end")
        self.end = offset + nbytes
        start = self.data_start + offset
        raw: memoryview | bytearray = self.view[start : start + nbytes]
        if isinstance(raw, memoryview) and raw.readonly:
            raw = bytearray(raw)  # the one copy; a writable buffer is used in place
        data = torch.frombuffer(raw, dtype=torch.uint8)
        if stored == torch.bool and bool((data > 1).any()):
            raise WireError("bool tensor holds bytes other than 0 and 1")
        if codec == Compression.INT8:
            return _dequantize_int8_blocks(data, numel, params[0], dtype).view(shape)
        data = data.view(stored)
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
