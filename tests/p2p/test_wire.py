"""The wire codec: exact round trips, zero-copy decoding, codec error bounds, and hostile input."""

import math
import random
import struct
import warnings

import msgpack
import pytest
import torch

from peer.p2p.identity import Identity
from peer.p2p.wire import (
    ALIGNMENT,
    DEFAULT_LIMITS,
    TENSOR_EXT_CODE,
    Compression,
    LimitExceeded,
    Limits,
    WireError,
    check_message_size,
    compressed,
    decode,
    encode,
    encode_bytes,
    parts_nbytes,
)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
FLOATING = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def sample(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def roundtrip(obj, **kwargs):
    return decode(bytearray(encode_bytes(obj, **kwargs)))


def assert_same_tensor(got, expected):
    assert isinstance(got, torch.Tensor)
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


def message(body_obj, buffers=(), *, body_len=None):
    """Hand-assemble a message: header, msgpack body, and data section buffers placed at the given offsets."""
    body = msgpack.packb(body_obj, use_bin_type=True)
    head = struct.pack("<I", len(body) if body_len is None else body_len) + body
    data = bytearray()
    for offset, raw in buffers:
        data.extend(bytes(offset - len(data)))
        data.extend(raw)
    if not buffers:
        return bytearray(head)
    start = -(-len(head) // ALIGNMENT) * ALIGNMENT
    return bytearray(head + bytes(start - len(head)) + data)


def tensor_ext(dtype="float32", shape=(2,), compression=0, offset=0, nbytes=8, params=()):
    payload = msgpack.packb([dtype, list(shape), compression, offset, nbytes, list(params)])
    return msgpack.ExtType(TENSOR_EXT_CODE, payload)


# ------------------------------------------------------------------------------------------------ exact round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (0, 5), (1,), (7,), (3, 4, 5)], ids=str)
def test_roundtrip_every_dtype_and_shape(dtype, shape):
    tensor = sample(shape, dtype)
    assert_same_tensor(roundtrip(tensor), tensor)
    assert_same_tensor(decode(encode_bytes(tensor)), tensor)  # read-only buffer path too


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_non_contiguous(dtype):
    base = sample((6, 8), dtype, seed=1)
    cases = [base.t(), base[:, ::3], base[1:5, 2:7], base[::2].t(), base[0:1].expand(4, 8), base.t()[0]]
    for tensor in cases:
        assert_same_tensor(roundtrip(tensor), tensor)


def test_roundtrip_large_tensor_and_grad_tensor():
    tensor = torch.randn(1 << 20, generator=torch.Generator().manual_seed(2))
    assert_same_tensor(roundtrip(tensor), tensor)
    param = torch.nn.Parameter(torch.randn(3, 3))
    out = roundtrip({"w": param})["w"]
    assert torch.equal(out, param.detach()) and not out.requires_grad


def test_nested_structures_with_tensors():
    peer_id = Identity.from_seed(b"x" * 32).peer_id
    obj = {
        "method": "moe.forward",
        "args": [torch.ones(2, 3), (torch.arange(5), {"mask": torch.tensor([True, False])}), []],
        1: None,
        b"raw": peer_id,
        "numbers": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, float("inf"), True, False],
        "empty": {},
        "text": "héllo ✓",
    }
    out = roundtrip(obj)
    assert out["method"] == "moe.forward"
    assert_same_tensor(out["args"][0], torch.ones(2, 3))
    assert isinstance(out["args"][1], list)  # tuples decode as lists
    assert_same_tensor(out["args"][1][0], torch.arange(5))
    assert_same_tensor(out["args"][1][1]["mask"], torch.tensor([True, False]))
    assert out["args"][2] == []
    assert out[1] is None
    assert out[b"raw"] == bytes(peer_id) and type(out[b"raw"]) is bytes
    assert out["numbers"] == obj["numbers"]
    assert out["empty"] == {} and out["text"] == obj["text"]


def test_large_body_values_are_not_copied_again():
    blob = b"b" * 200_000
    parts = encode({"blob": blob, "t": torch.arange(3)})
    assert len(parts) > 2 and any(len(part) > 200_000 for part in parts)
    out = decode(b"".join(parts))
    assert out["blob"] == blob and out["t"].tolist() == [0, 1, 2]
    assert decode(encode_bytes("s" * 100_000)) == "s" * 100_000


def test_plain_objects_without_tensors_are_one_part():
    for obj in [None, 0, "x", b"", [], {"a": [1, {"b": 2}]}]:
        parts = encode(obj)
        assert len(parts) == 1
        assert decode(parts[0]) == obj


# ------------------------------------------------------------------------------------------- layout and zero copy


def test_encode_does_not_copy_contiguous_tensors_and_aligns_buffers():
    tensors = [torch.randn(100), torch.arange(7, dtype=torch.int16), torch.ones(3, 3, dtype=torch.bool)]
    parts = encode({"x": tensors, "meta": "m" * 37})
    views = [part for part in parts if isinstance(part, memoryview)]
    assert len(views) == 3
    position = 0
    starts = []
    for part in parts:
        if isinstance(part, memoryview):
            starts.append(position)
        position += len(part)
    assert all(start % ALIGNMENT == 0 for start in starts)
    assert position == parts_nbytes(parts) == len(b"".join(parts))
    for view, tensor in zip(views, tensors):
        assert torch.frombuffer(view, dtype=torch.uint8).data_ptr() == tensor.data_ptr()


def test_decode_is_zero_copy_on_a_writable_buffer():
    tensor = torch.arange(1000, dtype=torch.float32)
    buffer = bytearray(encode_bytes({"t": tensor, "u": torch.arange(4, dtype=torch.int64)}))
    out = decode(buffer)
    base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    for got in out.values():
        assert base <= got.data_ptr() and got.data_ptr() + got.nbytes <= base + len(buffer)
        assert (got.data_ptr() - base) % ALIGNMENT == 0
    out["t"][0] = 42.0  # the decoded tensor aliases the buffer
    assert decode(buffer)["t"][0] == 42.0
    del buffer  # the tensor keeps its memory alive
    assert out["t"][1:].equal(tensor[1:])


def test_decode_accepts_memoryview_slices_and_read_only_buffers():
    tensor = torch.randn(33, 3)
    raw = encode_bytes([tensor])
    padded = bytearray(b"\xff" * 64 + raw + b"\xee" * 10)
    assert_same_tensor(decode(memoryview(padded)[64 : 64 + len(raw)])[0], tensor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns about non-writable buffers; we must not hit that path
        out = decode(raw)[0]
        decode(memoryview(raw))
    assert_same_tensor(out, tensor)
    writable = bytearray(raw)
    copied = decode(memoryview(writable).toreadonly())[0]
    assert_same_tensor(copied, tensor)
    writable[-1] ^= 0xFF  # a read-only view was copied: later changes to the memory do not leak in
    assert_same_tensor(copied, tensor)
    out += 1  # a private, writable copy
    assert_same_tensor(decode(raw)[0], tensor)


# ------------------------------------------------------------------------------------------------------ compression


def test_float16_error_bound():
    gen = torch.Generator().manual_seed(3)
    exponents = torch.randint(-9, 5, (20000,), generator=gen)
    magnitudes = torch.cat(
        [
            torch.randn(20000, generator=gen, dtype=torch.float64) * 10.0**exponents,
            torch.tensor([65504.0, -65504.0, 65000.0, 6e-8, -6e-8, 1e-30, 0.0, 2.0**-14, 1.0 + 2.0**-11]),
        ]
    )
    for dtype in (torch.float32, torch.float64):
        x = magnitudes.clamp(-65504, 65504).to(dtype)
        out = roundtrip(x, compression=Compression.FLOAT16)
        assert out.dtype == dtype and out.shape == x.shape
        err = (out.double() - x.double()).abs()
        bound = torch.maximum(x.double().abs() * 2.0**-11, torch.full_like(err, 2.0**-25))
        if dtype == torch.float64:
            bound += x.double().abs() * 2.0**-24  # torch converts float64 to float16 through float32
        assert bool((err <= bound).all()), float((err - bound).max())


def test_float16_clamps_out_of_range_and_keeps_specials():
    x = torch.tensor([1e5, -1e9, 65519.0, float("inf"), float("-inf"), float("nan"), 1.0])
    out = roundtrip(x, compression=Compression.FLOAT16)
    assert out[:3].tolist() == [65504.0, -65504.0, 65504.0]
    assert out[3] == float("inf") and out[4] == float("-inf") and math.isnan(out[5]) and out[6] == 1.0


def test_float16_codec_halves_float32_and_leaves_2_byte_floats_exact():
    x = torch.randn(4096)
    assert len(encode_bytes(x, compression=Compression.FLOAT16)) < len(encode_bytes(x)) // 2 + 200
    for dtype in (torch.float16, torch.bfloat16):
        y = sample((100,), dtype)
        assert_same_tensor(roundtrip(y, compression=Compression.FLOAT16), y)


def uint8_bound(x):
    lo, hi = float(x.min()), float(x.max())
    eps = torch.finfo(x.dtype).eps
    return (hi - lo) / 510 + 4 * eps * max(abs(lo), abs(hi))


@pytest.mark.parametrize("dtype", FLOATING, ids=str)
def test_uint8_error_bound(dtype):
    gen = torch.Generator().manual_seed(4)
    scales = [1e-3, 1.0, 1e4]
    offsets = [0.0, 1e3]
    if dtype == torch.float32:
        scales += [1e30, 1e-30]
        offsets += [1e6]
    if dtype == torch.float64:
        scales += [1e200, 1e-200]
        offsets += [1e12]
    for scale in scales:
        for offset in offsets:
            x = (torch.randn(5000, generator=gen, dtype=torch.float64) * scale + offset).to(dtype)
            out = roundtrip(x, compression=Compression.UINT8)
            assert out.dtype == dtype and out.shape == x.shape
            err = float((out.double() - x.double()).abs().max())
            assert err <= uint8_bound(x), (scale, offset, err, uint8_bound(x))


def test_uint8_is_one_byte_per_element_and_handles_edge_cases():
    x = torch.randn(64, 64)
    assert len(encode_bytes(x, compression=Compression.UINT8)) < 64 * 64 + 200
    const = torch.full((3, 5), -2.75)
    assert_same_tensor(roundtrip(const, compression=Compression.UINT8), const)
    empty = torch.empty(0, 7, dtype=torch.float64)
    assert_same_tensor(roundtrip(empty, compression=Compression.UINT8), empty)
    scalar = torch.tensor(3.25)
    assert_same_tensor(roundtrip(scalar, compression=Compression.UINT8), scalar)
    transposed = torch.randn(30, 20).t()
    out = roundtrip(transposed, compression=Compression.UINT8)
    assert out.shape == transposed.shape and float((out - transposed).abs().max()) <= uint8_bound(transposed)
    specials = torch.tensor([1.0, float("nan"), float("inf")])  # cannot be quantized: sent exactly
    out = roundtrip(specials, compression=Compression.UINT8)
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == float("inf")
    assert (x == x.clone()).all()  # encoding never modifies the caller's tensor
    extreme = torch.tensor([-1.7e308, 1.7e308, 0.0], dtype=torch.float64)  # range overflows float64: exact
    assert_same_tensor(roundtrip(extreme, compression=Compression.UINT8), extreme)


def test_compression_leaves_integer_and_bool_tensors_exact():
    for dtype in DTYPES[4:]:
        x = sample((50,), dtype)
        for codec in Compression:
            assert_same_tensor(roundtrip(x, compression=codec), x)
            assert_same_tensor(roundtrip(compressed(x, codec)), x)


def test_compressed_marker_overrides_message_default():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    out = roundtrip({"lossy": compressed(x, Compression.UINT8), "exact": x})
    assert not torch.equal(out["lossy"], x) and float((out["lossy"] - x).abs().max()) <= uint8_bound(x)
    assert_same_tensor(out["exact"], x)
    out = roundtrip([compressed(x, Compression.NONE), x], compression=Compression.FLOAT16)
    assert_same_tensor(out[0], x)
    assert out[1].dtype == torch.float32 and not torch.equal(out[1], x)


# ---------------------------------------------------------------------------------------------------- encode errors


@pytest.mark.parametrize(
    "obj",
    [
        torch.zeros(3, dtype=torch.complex64),
        torch.zeros(3, dtype=torch.uint16),
        torch.zeros(2, 2).to_sparse(),
        object(),
        {1, 2},
        2**64,
        -(2**63) - 1,
        [compressed(torch.zeros(1), Compression.NONE), print],
    ],
    ids=lambda o: type(o).__name__,
)
def test_encode_rejects_what_it_cannot_send(obj):
    with pytest.raises(WireError):
        encode(obj)


def test_compression_arguments_are_validated():
    with pytest.raises(WireError):
        compressed("not a tensor", Compression.UINT8)
    with pytest.raises(WireError):
        compressed(torch.zeros(1), 99)
    with pytest.raises(WireError):
        encode(torch.zeros(1), compression=99)
    for density in (0, -0.5, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(WireError):
            compressed(torch.zeros(1), Compression.TOPK2, density=density)
        with pytest.raises(WireError):
            encode(torch.zeros(1), compression=Compression.TOPK2, density=density)


# --------------------------------------------------------------------------------------------------- hostile input


def test_random_bytes_never_raise_anything_but_wire_error():
    rng = random.Random(6)
    valid = encode_bytes({"a": [torch.arange(10), "s", {"k": torch.ones(2, 2, dtype=torch.float16)}], "b": 1.5})
    limits = Limits(max_message_bytes=1 << 16, max_tensor_elements=1 << 12)
    for case in range(3000):
        if case % 3 == 0:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200)))
        elif case % 3 == 1:  # plausible header, random body
            body = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 120)))
            data = struct.pack("<I", len(body)) + body
        else:  # a valid message with a few bytes flipped
            mutated = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.getrandbits(8)
            data = bytes(mutated)
        try:
            decode(bytearray(data) if case % 2 else data, limits=limits)
        except WireError:
            pass


def test_truncated_and_extended_messages_are_rejected():
    raw = encode_bytes({"t": torch.arange(20, dtype=torch.int32), "s": "x" * 10, "u": torch.ones(3)})
    for cut in range(len(raw)):
        with pytest.raises(WireError):
            decode(raw[:cut])
    with pytest.raises(WireError):
        decode(raw + b"\x00")
    plain = encode_bytes({"a": 1})
    with pytest.raises(WireError):
        decode(plain + b"\x00")


def test_body_length_past_the_end_and_trailing_garbage_in_body():
    with pytest.raises(WireError):
        decode(message([1, 2], body_len=1000))
    with pytest.raises(WireError):
        decode(struct.pack("<I", 0xFFFFFFFF) + b"\x90")
    body = msgpack.packb([1, 2]) + b"\xc0"  # two objects in one body
    with pytest.raises(WireError):
        decode(struct.pack("<I", len(body)) + body)
    with pytest.raises(WireError):
        decode(struct.pack("<I", 0))  # empty body is not an object


def test_tensor_header_claiming_10_to_the_12_elements_fails_before_allocating():
    huge = tensor_ext(shape=[10**6, 10**6], nbytes=4 * 10**12)
    with pytest.raises(LimitExceeded):
        decode(message([huge]))
    with pytest.raises(LimitExceeded):
        decode(message([tensor_ext(shape=[11], nbytes=44)], [(0, bytes(44))]), limits=Limits(max_tensor_elements=10))
    assert decode(message([tensor_ext(shape=[10], nbytes=40)], [(0, bytes(40))]), limits=Limits(max_tensor_elements=10))


@pytest.mark.parametrize(
    "ext, data",
    [
        (tensor_ext(dtype="complex64"), bytes(8)),
        (tensor_ext(dtype="object"), bytes(8)),
        (tensor_ext(dtype=5), bytes(8)),
        (tensor_ext(nbytes=12), bytes(12)),  # length does not match shape
        (tensor_ext(shape=[-2]), bytes(8)),
        (tensor_ext(shape=[2.0]), bytes(8)),
        (tensor_ext(shape=[2**63, 0], nbytes=0), b""),  # torch cannot even describe it
        (tensor_ext(offset=64), bytes(8)),  # past the end
        (tensor_ext(offset=-64), bytes(8)),
        (tensor_ext(compression=7), bytes(8)),
        (tensor_ext(dtype="int32", compression=1, nbytes=4), bytes(8)),  # codec on an integer tensor
        (tensor_ext(compression=2, nbytes=2, params=[0.0]), bytes(2)),
        (tensor_ext(compression=2, nbytes=2, params=[0.0, -1.0]), bytes(2)),
        (tensor_ext(compression=2, nbytes=2, params=[0.0, float("nan")]), bytes(2)),
        (tensor_ext(params=[1.0]), bytes(8)),
        (tensor_ext(dtype="bool", nbytes=2), b"\x00\x02"),  # not a valid bool
        (msgpack.ExtType(TENSOR_EXT_CODE, b"\x93\x01\x02\x03"), bytes(8)),
        (msgpack.ExtType(TENSOR_EXT_CODE, b"\xff\xff"), bytes(8)),
        (msgpack.ExtType(42, b"abc"), b""),
    ],
)
def test_bad_tensor_headers_are_rejected(ext, data):
    with pytest.raises(WireError):
        decode(message({"t": ext}, [(0, data)] if data else []))


def test_overlapping_and_misaligned_buffers_are_rejected():
    ok = message([tensor_ext(offset=0), tensor_ext(offset=64)], [(0, bytes(8)), (64, bytes(8))])
    assert len(decode(ok)) == 2
    with pytest.raises(WireError):
        decode(message([tensor_ext(offset=0), tensor_ext(offset=0)], [(0, bytes(8))]))
    with pytest.raises(WireError):
        decode(message([tensor_ext(offset=4)], [(4, bytes(8))]))
    with pytest.raises(WireError):
        decode(message([tensor_ext(offset=64), tensor_ext(offset=0)], [(0, bytes(8)), (64, bytes(8))]))


def test_timestamp_extension_is_not_a_wire_object():
    body = b"\xd6\xff\x00\x00\x00\x00"  # msgpack's built-in timestamp ext
    with pytest.raises(WireError):
        decode(struct.pack("<I", len(body)) + body)


def test_deep_nesting_is_refused_without_recursion_error():
    body = b"\x91" * 10_000 + b"\xc0"
    with pytest.raises(LimitExceeded):
        decode(struct.pack("<I", len(body)) + body)
    nested = None
    for _ in range(DEFAULT_LIMITS.max_depth):
        nested = [nested]
    assert decode(encode_bytes(nested)) == nested
    with pytest.raises(LimitExceeded):
        decode(encode_bytes({"x": nested}))
    with pytest.raises(LimitExceeded):
        decode(encode_bytes({"a": {"b": [1]}}), limits=Limits(max_depth=2))
    with pytest.raises(WireError):
        encode(_deep(10_000))  # the encoder refuses too, with our error type


def _deep(n):
    obj = []
    for _ in range(n):
        obj = [obj]
    return obj


def test_size_limits():
    with pytest.raises(LimitExceeded):
        decode(encode_bytes("x" * (DEFAULT_LIMITS.max_str_len + 1)))
    small = Limits(max_str_len=10, max_bin_len=10, max_container_len=10, max_message_bytes=1000)
    assert decode(encode_bytes(["x" * 10, b"y" * 10, list(range(10))]), limits=small)
    for obj in ["x" * 11, b"y" * 11, list(range(11)), {i: i for i in range(11)}, "x" * 2000]:
        with pytest.raises(LimitExceeded):
            decode(encode_bytes(obj), limits=small)


def test_check_message_size():
    check_message_size(4)
    check_message_size(DEFAULT_LIMITS.max_message_bytes)
    with pytest.raises(LimitExceeded):
        check_message_size(DEFAULT_LIMITS.max_message_bytes + 1)
    with pytest.raises(LimitExceeded):
        check_message_size(101, Limits(max_message_bytes=100))
    with pytest.raises(WireError):
        check_message_size(3)
    raw = encode_bytes(torch.zeros(100))
    with pytest.raises(LimitExceeded):
        decode(raw, limits=Limits(max_message_bytes=len(raw) - 1))
    assert decode(raw, limits=Limits(max_message_bytes=len(raw))).shape == (100,)


def test_decode_rejects_non_buffers_and_unhashable_keys():
    for bad in [None, 5, "text", [1, 2]]:
        with pytest.raises(WireError):
            decode(bad)
    body = b"\x81\x91\x01\x02"  # {[1]: 2}
    with pytest.raises(WireError):
        decode(struct.pack("<I", len(body)) + body)
    body = b"\xa2\xff\xfe"  # invalid UTF-8
    with pytest.raises(WireError):
        decode(struct.pack("<I", len(body)) + body)
