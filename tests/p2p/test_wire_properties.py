"""Property tests of the wire codec (peer/p2p/wire.py) on structured inputs random bytes never reach.

Random bytes almost never get past the 4-byte length prefix; these tests generate *valid* messages (arbitrary
nested values, tensors of every dtype in `wire.DTYPES` and every kind of shape and layout) and check exact or
documented-bound round trips, then break exactly one field of one tensor header and check that decoding either
raises `WireError` or yields tensors that match what the (mutated) header says and the bytes that are there --
never another exception, never a tensor of the wrong size.

Hypothesis runs under the `ci` profile registered in tests/conftest.py (derandomized, a modest number of
examples, no deadline); `HYPOTHESIS_PROFILE=thorough` runs many more.
"""

from __future__ import annotations

import math
import struct

import msgpack
import pytest
import torch
from hypothesis import assume, example, given, note, settings
from hypothesis import strategies as st

from peer.p2p import wire
from peer.p2p.wire import ALIGNMENT, Compression, LimitExceeded, Limits, WireError

FLOATING = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in wire.DTYPES.items()}

# ------------------------------------------------------------------------------------------------- strategies

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)  # [] is 0-d; any 0 makes the tensor empty
dtype_names = st.sampled_from(sorted(wire.DTYPES))


@st.composite
def tensors(draw, dtype_name=dtype_names, shape=shapes):
    """A tensor whose bytes are drawn directly, so every bit pattern (NaN payloads, infinities, subnormals,
    -0.0) occurs, in one of several layouts: contiguous, transposed, strided, offset into its storage or
    broadcast with stride 0."""
    name = draw(dtype_name)
    dims = draw(shape)
    dtype = wire.DTYPES[name]
    layout = draw(st.sampled_from(["contiguous", "permuted", "stepped", "offset", "expanded"]))
    base_dims = list(dims)
    if layout == "stepped" and base_dims:
        base_dims[0] *= 2
    if layout == "offset":
        base_dims = [base_dims[0] + 1] + base_dims[1:] if base_dims else [2]
    if layout == "expanded" and base_dims:
        base_dims[0] = 1 if base_dims[0] else 0
    numel = math.prod(base_dims)
    raw = draw(st.binary(min_size=numel * ITEMSIZE[name], max_size=numel * ITEMSIZE[name]))
    if dtype == torch.bool:
        raw = bytes(b & 1 for b in raw)
    base = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(base_dims) if numel else \
        torch.empty(base_dims, dtype=dtype)
    if layout == "permuted":
        tensor = base.permute(*reversed(range(base.dim()))) if base.dim() else base
    elif layout == "stepped":
        tensor = base[::2] if base.dim() else base
    elif layout == "offset":
        tensor = base[1:] if dims else base[1]
    elif layout == "expanded" and dims:
        tensor = base.expand(dims)
    else:
        tensor = base
    if layout != "permuted":
        assert list(tensor.shape) == dims
    return tensor


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
keys = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=10) | st.binary(max_size=10)
values = st.recursive(
    scalars | tensors(shape=st.lists(st.integers(0, 3), max_size=3)),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=12,
)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's values as bytes, whatever its layout (a fresh dense copy, so any stride works)."""
    dense = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
    return bytes(dense.reshape(-1).view(torch.uint8).numpy())


def same(got, expected) -> bool:
    """Exact equality as the codec promises it: same types (tuples come back as lists), floats bit for bit,
    tensors with the same dtype, shape and bytes."""
    if isinstance(expected, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == expected.dtype
            and got.shape == expected.shape
            and raw_bytes(got) == raw_bytes(expected)
        )
    if type(expected) is float:
        return type(got) is float and struct.pack("<d", got) == struct.pack("<d", expected)
    if isinstance(expected, (list, tuple)):
        return type(got) is list and len(got) == len(expected) and all(map(same, got, expected))
    if isinstance(expected, dict):
        return type(got) is dict and got.keys() == expected.keys() and all(same(got[k], v) for k, v in expected.items())
    return type(got) is type(expected) and got == expected


def roundtrip(obj, **kwargs):
    return wire.decode(bytearray(wire.encode_bytes(obj, **kwargs)))


# -------------------------------------------------------------------------------------------- exact round trips


@given(tensors())
@example(torch.zeros(2, dtype=torch.bfloat16)[::2])  # one element with stride 2: counted contiguous (fixed)
def test_every_dtype_shape_and_layout_roundtrips_exactly(tensor):
    assert same(roundtrip(tensor), tensor)
    assert same(wire.decode(wire.encode_bytes(tensor)), tensor)  # read-only buffer: the one-copy path


@given(values)
def test_arbitrary_nested_values_roundtrip_exactly(value):
    assert same(roundtrip(value), value)


@given(st.lists(tensors(), min_size=1, max_size=4))
def test_buffers_are_aligned_in_order_and_the_message_ends_with_the_last(batch):
    message = wire.encode_bytes(batch)
    (body_len,) = struct.unpack_from("<I", message)
    data_start = -(-(4 + body_len) // ALIGNMENT) * ALIGNMENT
    headers = []
    msgpack.unpackb(message[4:4 + body_len], ext_hook=lambda code, data: headers.append(msgpack.unpackb(data)))
    end = 0
    for _name, _shape, _codec, offset, nbytes, _params in headers:
        if nbytes:
            assert (data_start + offset) % ALIGNMENT == 0 and offset >= end
            end = offset + nbytes
    assert len(message) == (data_start + end if end else 4 + body_len)


# ------------------------------------------------------------------------------------- compressed round trips

FLOAT16_MAX = 65504.0


def floats_for(dtype: torch.dtype) -> st.SearchStrategy[float]:
    width = {torch.float16: 16, torch.float32: 32, torch.float64: 64, torch.bfloat16: 32}[dtype]
    return st.floats(allow_nan=True, allow_infinity=True, width=width)


@st.composite
def float_tensors(draw, allow_nonfinite=True):
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    info = torch.finfo(dtype)
    # values spread over the dtype's whole range, or confined to its subnormals, to one binade or to float16's
    # range: the codecs' edge cases (overflowing spans, steps among subnormals, clamping) need such tensors
    magnitude = draw(st.sampled_from([None, "extremes", info.max, info.tiny, info.tiny * 64, 1.0, 2 * FLOAT16_MAX]))
    width = {torch.float16: 16, torch.float32: 32, torch.float64: 64, torch.bfloat16: 32}[dtype]
    if magnitude == "extremes":  # the ends of the dtype's range, mixed with anything in it
        ends = [info.max, -info.max, info.max / 2, -info.max / 2, info.tiny, -info.tiny, 0.0]
        elements = st.sampled_from(ends) | st.floats(-info.max, info.max, width=width)
    elif magnitude is None:
        elements = floats_for(dtype) if allow_nonfinite else floats_for(dtype).filter(math.isfinite)
    else:
        magnitude = min(magnitude, info.max)
        elements = st.floats(-magnitude, magnitude, width=width)
    data = draw(st.lists(elements, min_size=0, max_size=24))
    tensor = torch.tensor(data, dtype=torch.float64).to(dtype)
    if not allow_nonfinite:
        assume(bool(torch.isfinite(tensor).all()))
    return tensor


# the codecs' edge cases need a few more examples than the profile's default to be reached reliably
more_examples = settings(max_examples=max(150, settings.default.max_examples))


@more_examples
@given(float_tensors())
@example(torch.tensor([65519.0, -1e30, 3e-8], dtype=torch.float32))
def test_float16_codec_stays_within_its_documented_error(tensor):
    got = roundtrip(tensor, compression=Compression.FLOAT16)
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    if tensor.dtype in (torch.float16, torch.bfloat16):
        assert same(got, tensor)  # sent unchanged
        return
    for x, y in zip(tensor.tolist(), got.tolist()):
        if math.isnan(x):
            assert math.isnan(y)
        elif math.isinf(x):
            assert y == x
        elif abs(x) > FLOAT16_MAX:
            assert y == math.copysign(FLOAT16_MAX, x)
        else:
            bound = max(abs(x) * 2**-11, 2**-25)
            if tensor.dtype == torch.float64:
                bound += abs(x) * 2**-24
            assert abs(x - y) <= bound, (x, y, bound)


@more_examples
@given(float_tensors())
@example(torch.tensor([-3e38, 3e38], dtype=torch.float32))  # range wider than float32: decoded to inf (fixed)
@example(torch.tensor([0.0, 1.7976931348623157e308], dtype=torch.float64))  # 255 * (span / 255) > max (fixed)
@example(torch.tensor([1e-39, 3e-39, 2e-39], dtype=torch.float32))  # step among float32 subnormals
def test_uint8_codec_stays_within_its_documented_error(tensor):
    got = roundtrip(tensor, compression=Compression.UINT8)
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    values = tensor.double()
    if tensor.numel() == 0:
        return
    if not bool(torch.isfinite(values).all()) or not math.isfinite(float(values.max()) - float(values.min())):
        assert same(got, tensor)  # 8 bits cannot represent it: sent uncompressed
        return
    lo, hi = float(values.min()), float(values.max())
    if lo == hi:
        assert torch.equal(got, tensor)  # a constant tensor is exact (as a number: -0.0 may come back as 0.0)
        return
    eps = torch.finfo(tensor.dtype).eps
    bound = (hi - lo) / 510 + 4 * eps * max(abs(lo), abs(hi))
    error = float((got.double() - values).abs().max())
    note(f"error {error!r}, bound {bound!r}")
    assert error <= bound


# ------------------------------------------------------------------------------- one tensor header field wrong


def split_message(message: bytes) -> tuple[list, list, bytes]:
    """(body with tensors as ExtType, their decoded headers, the data section) of a valid message."""
    (body_len,) = struct.unpack_from("<I", message)
    data_start = -(-(4 + body_len) // ALIGNMENT) * ALIGNMENT
    headers = []

    def hook(code, data):
        headers.append(msgpack.unpackb(data))
        return msgpack.ExtType(code, data)

    body = msgpack.unpackb(message[4:4 + body_len], ext_hook=hook, strict_map_key=False)
    data = message[data_start:] if len(message) > 4 + body_len else b""
    return body, headers, data


def join_message(body, data: bytes) -> bytearray:
    packed = msgpack.packb(body, use_bin_type=True)
    head = struct.pack("<I", len(packed)) + packed
    if data:
        head += bytes(-len(head) % ALIGNMENT)
    return bytearray(head + data)


def replace_ext(body, index: int, new_payload: bytes):
    """The body with its `index`-th tensor's ext payload replaced (body order = msgpack order)."""
    seen = [0]

    def walk(node):
        if isinstance(node, msgpack.ExtType):
            seen[0] += 1
            return msgpack.ExtType(node.code, new_payload) if seen[0] - 1 == index else node
        if isinstance(node, list):
            return [walk(item) for item in node]
        if isinstance(node, dict):
            return {key: walk(item) for key, item in node.items()}
        return node

    return walk(body)


FIELDS = ["dtype", "shape", "compression", "offset", "nbytes", "params"]
junk = st.sampled_from([None, True, 1.5, "x", b"\x00", [], {}, -1, 2**63, 2**64 - 1])


@st.composite
def mutations(draw, header):
    """(field index, new value, surely_invalid) for one field of `header`; `surely_invalid` is True when the
    format rules (module docstring of peer.p2p.wire) leave no valid reading, False when the header may still be
    consistent (e.g. a reshape keeping the element count), in which case the decoded tensor is checked instead."""
    name, shape, codec, offset, nbytes, params = header
    field = draw(st.sampled_from(FIELDS))
    index = FIELDS.index(field)
    stored = {0: ITEMSIZE[name], 1: 2, 2: 1}[codec]
    numel = math.prod(shape)
    if field == "dtype":
        new = draw(st.sampled_from(sorted(wire.DTYPES)) | st.text(max_size=8) | junk
                   | st.just("torch.float32") | st.just("Float32"))
        assume(new != name)
        if type(new) is not str or new not in wire.DTYPES:
            return index, new, True
        if codec == 0:
            return index, new, ITEMSIZE[new] != ITEMSIZE[name] and numel > 0
        return index, new, wire.DTYPES[new] not in FLOATING
    if field == "shape":
        new = draw(
            st.lists(st.integers(0, 6), max_size=5)
            | st.lists(st.integers(-(2**63), 2**64 - 1), min_size=1, max_size=3)
            | st.lists(st.integers(1, 1), min_size=65, max_size=70)  # more dims than torch allows
            | st.lists(junk, min_size=1, max_size=2)
            | junk
        )
        assume(new != shape)
        well_formed = isinstance(new, list) and all(type(d) is int and 0 <= d < 2**63 for d in new)
        if not well_formed or len(new) > 64:
            return index, new, True
        return index, new, math.prod(new) != numel
    if field == "compression":
        new = draw(st.integers(-3, 300) | junk)
        assume(new != codec)
        if type(new) is not int or new not in (0, 1, 2):
            return index, new, True
        new_stored = {0: ITEMSIZE[name], 1: 2, 2: 1}[new]
        return index, new, (
            (new != 0 and wire.DTYPES[name] not in FLOATING)
            or (numel > 0 and new_stored != stored)
            or ((new == 2) != (codec == 2))  # the 8-bit codec needs [min, scale], the others no params
        )
    if field == "offset":
        new = draw(st.integers(-(2**63), 2**64 - 1) | st.sampled_from([offset + 1, offset - 1, offset + ALIGNMENT,
                                                                        offset - ALIGNMENT]) | junk)
        assume(new != offset)
        # a non-empty buffer has exactly one place (aligned, after the previous one, the message ending with
        # the last); an empty tensor's offset is ignored but must still be a non-negative int
        return index, new, nbytes > 0 or type(new) is not int or new < 0
    if field == "nbytes":
        new = draw(st.integers(-(2**63), 2**64 - 1) | st.sampled_from([nbytes + 1, nbytes - 1, 2 * nbytes + 8,
                                                                        0]) | junk)
        assume(new != nbytes)
        return index, new, True  # nbytes must equal numel * itemsize: any other value is wrong
    new = draw(
        st.lists(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**63), 2**63 - 1) | junk,
                 max_size=3)
        | junk
    )
    assume(new != params)
    if codec != 2:
        return index, new, True
    valid = (isinstance(new, list) and len(new) == 2
             and all(type(p) in (int, float) and math.isfinite(p) for p in new) and new[1] >= 0)
    return index, new, not valid


@st.composite
def mutated_messages(draw):
    batch = draw(st.lists(tensors(shape=st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=3))
    # the blockwise codecs' header rules (scales inside the buffer) are checked in tests/averaging/test_diloco.py
    # (INT8) and tests/p2p/test_wire_codecs.py (INT4, INT2, TOPK2, TOPK8)
    codec = draw(st.sampled_from([Compression.NONE, Compression.FLOAT16, Compression.UINT8]))
    message = wire.encode_bytes([draw(scalars), batch], compression=codec)
    body, headers, data = split_message(message)
    target = draw(st.integers(0, len(headers) - 1))
    field, new, surely_invalid = draw(mutations(headers[target]))
    header = list(headers[target])
    header[field] = new
    note(f"tensor {target}: {FIELDS[field]} {headers[target][field]!r} -> {new!r}")
    payload = msgpack.packb(header, use_bin_type=True)
    return join_message(replace_ext(body, target, payload), data), header, target, surely_invalid


def tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list):
        return [t for item in value for t in tensors_in(item)]
    return []


@given(mutated_messages())
@example((join_message([None, [msgpack.ExtType(1, msgpack.packb(["float32", [2], 0, 0, 7, []]))]], bytes(8)),
          ["float32", [2], 0, 0, 7, []], 0, True))
def test_one_wrong_tensor_header_field_is_a_wire_error_or_a_consistent_tensor(case):
    message, header, target, surely_invalid = case
    try:
        decoded = wire.decode(message)
    except WireError:
        return
    assert not surely_invalid, "a header the format rules forbid was accepted"
    tensor = tensors_in(decoded)[target]
    name, shape, codec, offset, nbytes, _params = header
    assert tensor.dtype == wire.DTYPES[name] and list(tensor.shape) == shape  # never a tensor of another size
    if codec == 0 and nbytes:
        (body_len,) = struct.unpack_from("<I", message)
        start = -(-(4 + body_len) // ALIGNMENT) * ALIGNMENT + offset
        assert raw_bytes(tensor) == bytes(message[start:start + nbytes])


# --------------------------------------------------------------------------------- limits before allocation


def nested(depth: int, kinds: list[str]):
    value: object = 0
    for level in range(depth):
        value = [value] if kinds[level % len(kinds)] == "list" else {"k": value}
    return value


@given(st.integers(1, 80), st.integers(1, 40), st.lists(st.sampled_from(["list", "dict"]), min_size=1, max_size=4))
def test_nesting_beyond_max_depth_is_refused_and_up_to_it_accepted(depth, max_depth, kinds):
    message = bytearray(wire.encode_bytes(nested(depth, kinds)))
    limits = Limits(max_depth=max_depth)
    if depth > max_depth:
        with pytest.raises(LimitExceeded):
            wire.decode(message, limits=limits)
    else:
        wire.decode(message, limits=limits)


@given(st.integers(0, 300), st.integers(0, 300), st.sampled_from(["str", "bin", "list", "dict"]))
def test_length_limits_are_exact(length, limit, kind):
    value = {"str": "é" * (length // 2) + "a" * (length % 2), "bin": b"\x01" * length,
             "list": [0] * length, "dict": {i: 0 for i in range(length)}}[kind]
    field = {"str": "max_str_len", "bin": "max_bin_len", "list": "max_container_len", "dict": "max_container_len"}
    limits = Limits(**{field[kind]: limit})
    message = bytearray(wire.encode_bytes(value))
    if length > limit:
        with pytest.raises(LimitExceeded):
            wire.decode(message, limits=limits)
    else:
        assert same(wire.decode(message, limits=limits), value)


@given(st.sampled_from([b"\xdd", b"\xdf", b"\xdb", b"\xc6"]), st.integers(0, 2**32 - 1), st.integers(0, 2**32),
       st.binary(max_size=16))
def test_claimed_container_lengths_are_refused_before_allocating(marker, claimed, limit, tail):
    """array32 / map32 headers claiming up to 4 G items in a tiny body: msgpack would preallocate them, so the
    limit (cut to what the body could hold) must refuse them first. str32 / bin32 claims are never allocated
    before their bytes are there: any WireError will do."""
    body = marker + struct.pack(">I", claimed) + tail
    message = struct.pack("<I", len(body)) + body
    limits = Limits(max_str_len=limit, max_bin_len=limit, max_container_len=limit)
    cap = min(limit, len(body) // 2 if marker == b"\xdf" else len(body))
    assume(claimed > cap)
    expected = LimitExceeded if marker in (b"\xdd", b"\xdf") else WireError
    with pytest.raises(expected):
        wire.decode(message, limits=limits)


@given(st.lists(st.integers(1, 2**20), min_size=1, max_size=3), st.sampled_from(sorted(wire.DTYPES)))
def test_tensor_element_limit_is_checked_before_any_tensor_is_made(shape, name):
    numel = math.prod(shape)
    limits = Limits(max_tensor_elements=1000)
    assume(numel > limits.max_tensor_elements)
    header = msgpack.packb([name, shape, 0, 0, numel * ITEMSIZE[name], []], use_bin_type=True)
    body = msgpack.packb([msgpack.ExtType(wire.TENSOR_EXT_CODE, header)], use_bin_type=True)
    message = struct.pack("<I", len(body)) + body + bytes(-(4 + len(body)) % ALIGNMENT) + bytes(64)
    made = []
    originals = (torch.empty, torch.frombuffer)
    torch.empty = lambda *a, **k: made.append(a) or originals[0](*a, **k)
    torch.frombuffer = lambda *a, **k: made.append(a) or originals[1](*a, **k)
    try:
        with pytest.raises(LimitExceeded):
            wire.decode(message, limits=limits)
    finally:
        torch.empty, torch.frombuffer = originals
    assert made == []


# ------------------------------------------------------------------------------ the generation goes deep


def test_mutated_messages_reach_the_tensor_header_checks(monkeypatch):
    """The mutation property is only worth something if its messages get past the length prefix and the msgpack
    body to the tensor header checks (random bytes almost never do): count the cases in which the tensor reader
    runs on the mutated header, and those that still decode (valid readings exist, e.g. a reshape)."""
    reached = {"cases": 0, "reader": 0, "decoded": 0}
    original = wire._TensorReader.__call__

    def counting(self, code, payload):
        reached["reader"] += 1
        return original(self, code, payload)

    @settings(max_examples=200)  # enough that some mutations still have a valid reading, whatever the order
    @given(mutated_messages())
    def run(case):
        message, _header, _target, _surely = case
        reached["cases"] += 1
        before = reached["reader"]
        try:
            wire.decode(message)
            reached["decoded"] += 1
        except WireError:
            pass
        reached["reader"] = before + (reached["reader"] > before)  # count cases, not tensors

    monkeypatch.setattr(wire._TensorReader, "__call__", counting)
    run()
    assert reached["cases"] >= 20
    assert reached["reader"] == reached["cases"], reached
    assert 0 < reached["decoded"] < reached["cases"], reached


@given(tensors(), st.sampled_from(list(Compression)), st.booleans())
@example(torch.tensor([1.0, math.inf]), Compression.INT8, False)  # sent uncompressed, counted compressed
@example(torch.tensor(math.inf, dtype=torch.float16), Compression.INT4, False)
@example(torch.randn(9000, generator=torch.Generator().manual_seed(1)), Compression.TOPK2, True)
@example(torch.randn(9000, generator=torch.Generator().manual_seed(1)), Compression.TOPK8, False)
def test_data_nbytes_is_the_data_the_encoder_sends(tensor, compression, wrapped):
    item = wire.compressed(tensor, compression) if wrapped else tensor
    parts = wire.encode([item], compression=Compression.NONE if wrapped else compression)
    message = b"".join(parts)
    headers = []
    msgpack.unpackb(message[4:4 + struct.unpack("<I", message[:4])[0]],
                    ext_hook=lambda code, payload: headers.append(msgpack.unpackb(payload)))
    _, _, sent_codec, _, sent_nbytes, _ = headers[0]
    counted = wire.data_nbytes(item, Compression.NONE if wrapped else compression)
    if sent_codec == Compression.NONE and compression not in (Compression.NONE, Compression.FLOAT16) \
            and tensor.dtype in FLOATING and tensor.numel():
        # the documented exception: values a quantizing codec cannot hold went uncompressed
        if counted != sent_nbytes:
            wide = tensor.to(torch.float64)
            assert not bool(torch.isfinite(wide).all()) or float(wide.abs().max()) > 3.0e38
            return
    assert counted == sent_nbytes
