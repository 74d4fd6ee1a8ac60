"""The pseudo-gradient codecs of the wire (peer/p2p/wire.py): INT4, INT2, TOPK2, TOPK8.

Per codec: the documented error bound on generated inputs (checked against the scales and levels the message
carries), idempotence, the top-k selection (largest magnitudes, ties to the lower index, everything else exactly
zero), exact `data_nbytes`, error feedback bounded over 1,000 rounds, the same bytes from another process, and
hostile encodings (bad indices, scales, lengths, padding, parameters) refused with `MalformedTensor`, also when
they arrive in an RPC call: that call fails with a typed error and the connection keeps serving.
"""

from __future__ import annotations

import contextlib
import math
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
import trio
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from averaging.outer_state import ErrorFeedback
from peer.p2p import wire
from peer.p2p.rpc import BadRequest
from peer.p2p.wire import ALIGNMENT, Compression, MalformedTensor, WireError
from peer.testing import hand_rolled
from tests.p2p.rpc_peers import Swarmlet, raw_connect, send_raw_request
from tests.p2p.wire_inputs import determinism_inputs

ROOT = Path(__file__).resolve().parents[2]
NEW = [Compression.INT4, Compression.INT2, Compression.TOPK2, Compression.TOPK8]
TOPK = [Compression.TOPK2, Compression.TOPK8]
HALF_EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # relative rounding to the dtype

more_examples = settings(max_examples=max(100, settings.default.max_examples))


@contextlib.contextmanager
def chunk_size(chunk: int):
    """Top-k chunks of `chunk` elements for a while (small chunks put many chunks in a small tensor)."""
    saved = wire.TOPK_CHUNK
    wire.TOPK_CHUNK = chunk
    try:
        yield
    finally:
        wire.TOPK_CHUNK = saved


# ------------------------------------------------------------------------------------------------ helpers


def sent(tensor: torch.Tensor, codec: Compression, density: float | None = None):
    """(message, header, data bytes) of `tensor` sent alone with `codec`."""
    message = wire.encode_bytes(wire.compressed(tensor, codec, density=density))
    (body_len,) = struct.unpack_from("<I", message)
    headers: list = []
    msgpack.unpackb(message[4:4 + body_len], ext_hook=lambda code, data: headers.append(msgpack.unpackb(data)))
    header = headers[0]
    start = -(-(4 + body_len) // ALIGNMENT) * ALIGNMENT + header[3]
    return message, header, message[start:start + header[4]]


def forge(header: list, data: bytes) -> bytearray:
    """A message holding one tensor with this header and these data bytes."""
    body = msgpack.packb(msgpack.ExtType(wire.TENSOR_EXT_CODE, msgpack.packb(header, use_bin_type=True)),
                         use_bin_type=True)
    head = struct.pack("<I", len(body)) + body
    if data:
        head += bytes(-len(head) % ALIGNMENT)
    return bytearray(head + data)


def floats(data: bytes, count: int, start: int = 0) -> torch.Tensor:
    return torch.frombuffer(bytearray(data[start:start + 4 * count]), dtype=torch.float32).double()


def representable(x: torch.Tensor) -> bool:
    wide = x.double()
    return bool(torch.isfinite(wide).all()) and (wide.numel() == 0 or float(wide.abs().max()) <= 3.0e38)


def work(x: torch.Tensor) -> torch.Tensor:
    """The input as the codecs see it (float64; float16 and bfloat16 are exact in it)."""
    return x.reshape(-1).double()


def rounding(x: torch.Tensor, decoded: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Slack for "+ rounding": a few units in the last place of the block's scale (float32 arithmetic), plus the
    rounding of the decoded value to a 16-bit dtype."""
    slack = scale * 2.0**-20 + 2.0**-140
    if x.dtype in HALF_EPS:
        slack = slack + decoded.abs() * HALF_EPS[x.dtype] + 2.0**-24
    return slack


@st.composite
def pseudo_gradients(draw, max_size: int = 600):
    """Flat float tensors of every floating dtype: Gaussian at any scale, heavy-tailed, full of ties, mostly
    zeros, or arbitrary float32 values (subnormals, near float32's limit)."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    size = draw(st.integers(0, max_size))
    style = draw(st.sampled_from(["normal", "heavy", "ties", "sparse", "floats"]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if style == "normal":
        x = torch.randn(size, generator=generator, dtype=torch.float64) * 10.0 ** draw(st.integers(-40, 40))
    elif style == "heavy":
        x = torch.randn(size, generator=generator, dtype=torch.float64)
        x = x * torch.randn(size, generator=generator, dtype=torch.float64).mul(3).exp()
    elif style == "ties":
        x = torch.tensor(draw(st.lists(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, -2.0, 2.0]), min_size=size,
                                       max_size=size)), dtype=torch.float64)
    elif style == "sparse":
        x = torch.randn(size, generator=generator, dtype=torch.float64)
        x = x * (torch.rand(size, generator=generator, dtype=torch.float64) < 0.05)
    else:
        x = torch.tensor(draw(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False),
                                       min_size=size, max_size=size)), dtype=torch.float64)
    return x.to(dtype)


def check_common(x: torch.Tensor, codec: Compression, density: float | None = None) -> tuple | None:
    """Shape, dtype, exact data_nbytes, idempotence; None when the values went uncompressed (then exact)."""
    _message, header, data = sent(x, codec, density)
    y = wire.roundtrip(x, codec, density=density)
    assert y.dtype == x.dtype and y.shape == x.shape
    if not representable(x):
        assert header[2] == Compression.NONE and torch.equal(y.view(torch.uint8), x.view(torch.uint8))
        return None
    assert header[2] == codec
    assert len(data) == wire.data_nbytes(wire.compressed(x, codec, density=density))
    assert torch.equal(wire.roundtrip(y, codec, density=density), y), "not idempotent"
    return header, data, y


def check_blocked(x: torch.Tensor, codec: Compression, block: int) -> tuple | None:
    """`check_common` for a codec of per-block scales or levels, also checking that its header names `block`;
    returns (data, decoded, block, number of blocks), or None where there is nothing blocked to check."""
    common = check_common(x, codec)
    if common is None or x.numel() == 0:
        return None
    header, data, y = common
    assert header[5][0] == block
    return data, y, block, -(-x.numel() // block)


# ------------------------------------------------------------------------------------------- error bounds


@more_examples
@given(pseudo_gradients())
@example(torch.tensor([65504.0, -65504.0, 1.0], dtype=torch.float16))  # a scale rounded up: clamped, not inf
@example(torch.tensor([1e-45, -3e-45, 0.0] * 30, dtype=torch.float32))  # subnormals
def test_int4_stays_within_half_a_scale_and_is_idempotent(x):
    blocked = check_blocked(x, Compression.INT4, wire.INT4_BLOCK)
    if blocked is None:
        return
    data, y, block, blocks = blocked
    scales = floats(data, blocks).repeat_interleave(block)[:x.numel()]
    xs, ys = work(x), work(y)
    absmax = torch.nn.functional.pad(xs.abs(), (0, blocks * block - x.numel())).view(blocks, block).amax(1)
    assert bool((scales <= absmax.repeat_interleave(block)[:x.numel()] * 17 / 112 + 2.0**-126).all())
    error = (xs - ys).abs()
    assert bool((error <= scales / 2 + rounding(x, ys, scales)).all()), float((error - scales / 2).max())
    assert bool((ys[xs == 0] == 0).all())  # zeros are exact


def two_level_bounds(values: torch.Tensor, decoded: torch.Tensor, levels: torch.Tensor, x: torch.Tensor) -> None:
    """INT2's and TOPK2's promises on one row (float64 `values` and `decoded`): the row's two levels a <= b lie in
    [lo, hi] (its smallest and largest magnitude); each value is sent with its sign as the nearer level; the error
    is at most (hi - lo) / 2; the squared error at most that of sending each value as the nearer of lo and hi."""
    magnitude = values.abs()
    lo, hi = float(magnitude.min()), float(magnitude.max())
    a, b = float(levels[0]), float(levels[1])
    slack = hi * 2.0**-20 + 2.0**-140  # float32 rounding of the levels and of the comparisons
    assert lo - slack <= a <= b <= hi + slack, (lo, a, b, hi)
    sent_magnitude = decoded.abs()
    signed = decoded != 0
    assert bool(((decoded[signed] < 0) == (values[signed] < 0)).all()), "a sign was lost"
    half = HALF_EPS.get(x.dtype, 0.0)
    allowed = (hi - lo) / 2 + slack + sent_magnitude * half + (2.0**-24 if half else 0.0)
    assert bool(((values - decoded).abs() <= allowed).all())
    if half:
        return  # rounded to the dtype: the levels themselves are not what arrives
    assert bool(((sent_magnitude == a) | (sent_magnitude == b)).all())
    nearer = torch.minimum((magnitude - a).abs(), (magnitude - b).abs())
    assert bool(((magnitude - sent_magnitude).abs() <= nearer + slack).all())
    endpoints = torch.minimum(magnitude - lo, hi - magnitude)
    squared = float(((values - decoded) ** 2).sum())
    assert squared <= float((endpoints**2).sum()) + values.numel() * 4 * (hi + slack) * slack


@more_examples
@given(pseudo_gradients())
@example(torch.tensor([3.0] * 200))  # one level only
@example(torch.tensor([0.0, -0.0, 5.0, -1.0, 1e-30] * 40))
def test_int2_keeps_signs_and_sends_each_value_as_the_nearer_of_two_levels(x):
    blocked = check_blocked(x, Compression.INT2, wire.INT2_BLOCK)
    if blocked is None:
        return
    data, y, block, blocks = blocked
    levels = floats(data, 2 * blocks).view(blocks, 2)
    xs, ys = work(x), work(y)
    for index in range(blocks):
        part = slice(index * block, (index + 1) * block)
        two_level_bounds(xs[part], ys[part], levels[index], x)


def expected_kept(values: torch.Tensor, kept: int) -> list[int]:
    """The reference top-k: largest magnitude first, ties to the lower index."""
    magnitudes = values.abs().tolist()
    return sorted(sorted(range(len(magnitudes)), key=lambda i: (-magnitudes[i], i))[:kept])


@more_examples
@given(pseudo_gradients(), st.sampled_from([1, 7, 64, 4096]), st.sampled_from([None, 0.001, 0.05, 0.3, 1.0]),
       st.sampled_from(TOPK))
@example(torch.ones(100), 16, 0.25, Compression.TOPK2)  # all tied: the lowest indices of each chunk
@example(torch.zeros(50), 16, 0.25, Compression.TOPK8)
def test_topk_keeps_the_largest_of_each_chunk_within_the_value_bound_and_zeroes_the_rest(x, chunk, density, codec):
    with chunk_size(chunk):
        common = check_common(x, codec, density)
        if common is None or x.numel() == 0:
            return
        header, data, y = common
        assert tuple(header[5]) == wire.topk_params(x.numel(), density)
    kept_chunk, k = header[5]
    assert kept_chunk == min(chunk, x.numel())
    xs, ys = work(x), work(y)
    chunks = -(-x.numel() // kept_chunk)
    if codec == Compression.TOPK2:
        scales = floats(data, 2 * chunks).view(chunks, 2)
    else:
        scales = floats(data, chunks).view(chunks, 1)
    for index in range(chunks):
        part = slice(index * kept_chunk, (index + 1) * kept_chunk)
        values, decoded = xs[part], ys[part]
        kept = -(-k * values.numel() // kept_chunk)
        keep = expected_kept(values, kept)
        dropped = torch.ones(values.numel(), dtype=torch.bool)
        dropped[keep] = False
        assert bool((decoded[dropped] == 0).all()), "an element not kept is not exactly zero"
        note(f"chunk {index}: kept {keep}")
        if codec == Compression.TOPK2:
            two_level_bounds(values[keep], decoded[keep], scales[index], x)
        else:
            scale = float(scales[index, 0])
            error = (values[keep] - decoded[keep]).abs()
            slack = rounding(x, decoded[keep], torch.tensor(scale))
            assert bool((error <= scale / 2 + slack).all())
            assert bool((error <= values[keep].abs() + slack).all())
            assert scale <= 2 * float(values[keep].abs().max()) / 127 + 2.0**-149


def test_topk_indices_cost_about_two_bits_plus_log2_of_one_over_density():
    """Elias-Fano: 82 of 4096 (2%) take 5 low bits each plus a high bit vector of 82 + 128 bits, 7.6 bits an
    index against 12 for plain indices; chunks over 4096 need no wider indices; the size is what data_nbytes says."""
    assert wire._elias_fano(4096, 82) == (5, 82 + 128)
    assert wire._elias_fano(4096, 4096) == (0, 8192)
    assert wire._elias_fano(1, 1) == (0, 2)
    x = torch.randn(12_001, generator=torch.Generator().manual_seed(3))
    with chunk_size(5000):
        _message, header, data = sent(x, Compression.TOPK8, 0.01)
        y = wire.roundtrip(x, Compression.TOPK8, density=0.01)
        counted = wire.data_nbytes(wire.compressed(x, Compression.TOPK8, density=0.01))
    assert header[5] == [5000, 50]
    kept = 2 * 50 + 21  # the last chunk of 2001 keeps ceil(50 * 2001 / 5000)
    index_bytes = -(-2 * (50 + 79) // 8) + -(-2 * 50 * 6 // 8) + -(-(21 + 32) // 8) + -(-21 * 6 // 8)
    assert len(data) == 3 * 4 + index_bytes + kept == counted
    assert index_bytes * 8 / kept < 9.0  # against 16 bits when chunks over 4096 took uint16 indices
    assert int((y != 0).sum()) == kept
    for index in range(3):
        part = x[index * 5000:(index + 1) * 5000]
        assert sorted(torch.nonzero(y[index * 5000:(index + 1) * 5000]).view(-1).tolist()) == \
            expected_kept(part, -(-50 * part.numel() // 5000))


def test_the_receiver_reads_the_density_from_the_header_not_its_own_default():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(4))
    message, header, _ = sent(x, Compression.TOPK2, 0.1)
    assert header[5] == [4096, 410]
    saved = wire.default_density()
    try:
        wire.set_default_density(0.5)
        assert wire.default_density() == 0.5
        decoded = wire.decode(bytearray(message))
        assert int((decoded != 0).sum()) == 410 * 2 + math.ceil(410 * (10_000 - 8192) / 4096)
        assert wire.topk_params(10_000) == (4096, 2048)  # what this process now sends by default
        assert sent(x, Compression.TOPK2)[1][5] == [4096, 2048]
        assert sent(x, Compression.TOPK2, 0.1)[1][5] == [4096, 410]  # a tensor's own density wins
        with pytest.raises(WireError):
            wire.set_default_density(0.0)
    finally:
        wire.set_default_density(saved)
    assert wire.topk_params(10_000) == (4096, math.ceil(wire.TOPK_DENSITY * 4096))
    assert wire.topk_params(100) == (100, 2) and wire.topk_params(0) == (1, 1)


def test_peer_train_density_option_defaults_to_the_codec_default_and_stays_in_range(capsys):
    from peer.train import build_parser

    assert build_parser().parse_args([]).density == wire.TOPK_DENSITY  # one default, stated twice: kept equal
    assert build_parser().parse_args(["--density", "0.05"]).density == 0.05
    for bad in ("0", "1.5", "nan"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--density", bad])
    assert "--density" in capsys.readouterr().err


@given(st.integers(0, 20_000), st.sampled_from(NEW), st.sampled_from([None, 0.001, 0.02, 0.5, 1.0]),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_data_nbytes_is_exactly_what_the_new_codecs_send(numel, codec, density, dtype):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    _message, header, data = sent(x, codec, density)
    assert header[4] == len(data) == wire.data_nbytes(wire.compressed(x, codec, density=density))
    if numel and density is None:
        assert wire.data_nbytes(x, codec) == len(data)


def test_sizes_at_the_defaults():
    numel = 4096 * 100
    x = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    ratios = {codec: wire.data_nbytes(x, codec) / (4 * numel) for codec in NEW}
    assert ratios[Compression.INT4] == pytest.approx((0.5 + 4 / 64) / 4)
    assert ratios[Compression.INT2] == pytest.approx((0.25 + 8 / 128) / 4)
    assert ratios[Compression.TOPK2] < 1 / 150 and ratios[Compression.TOPK8] < 1 / 99
    index_bytes = (82 * 5 + 82 + 128) / 8  # Elias-Fano: 5 low bits each, a high bit vector of 82 + 128 bits
    assert ratios[Compression.TOPK2] == pytest.approx((8 + index_bytes + 82 / 4) / (4 * 4096), rel=1e-3)


# -------------------------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("codec", NEW, ids=lambda c: c.name)
@pytest.mark.parametrize("kind", ["heavy", "constant"])
def test_error_feedback_residual_stays_bounded_over_1000_rounds(codec, kind):
    """The residual after each round is bounded by the codec's contraction, and the sum of what was sent tracks
    the sum of the inputs to within the last residual, however many rounds (inputs: fresh Gaussian noise on
    heavy-tailed per-coordinate magnitudes each round, or one constant gradient): INT4 and INT2 per element
    (|e| <= 17/224 |x| and <= |x| / 2 of the block's largest input, so at most 17/207 and 1 times the largest
    gradient element), the top-k codecs in norm (top-k at density d is a contraction with factor sqrt(1 - d):
    ||e|| <= sqrt(1 - d) / (1 - sqrt(1 - d)) max ||g||, about 99 at 2%). A constant gradient is the hard case of
    top-k: each coordinate waits for its turn, so the residual grows before it levels off."""
    numel = 2 * 4096 + 300 if codec in TOPK else 1000  # below torch's parallel grain: no thread wake-ups
    generator = torch.Generator().manual_seed(11)
    constant = torch.randn(numel, generator=generator)
    scale = torch.randn(numel, generator=generator).mul(2).exp()  # heavy-tailed magnitudes across coordinates
    feedback = ErrorFeedback([torch.zeros(numel)], codec)
    inputs = torch.zeros(numel, dtype=torch.float64)
    outputs = torch.zeros(numel, dtype=torch.float64)
    norms, largest_norm, largest_element, residual_element = [], 0.0, 0.0, 0.0
    for _ in range(1000):
        if kind == "constant":
            gradient = constant.clone()
        else:
            gradient = torch.randn(numel, generator=generator) * scale
        largest_norm = max(largest_norm, float(gradient.norm()))
        largest_element = max(largest_element, float(gradient.abs().max()))
        inputs += gradient
        values = [gradient]
        feedback.compress(values)
        feedback.commit()
        outputs += values[0]
        residual = feedback.residuals[0]
        norms.append(float(residual.norm()))
        residual_element = max(residual_element, float(residual.abs().max()))
    drift = (inputs - outputs - feedback.residuals[0].double()).abs().max()
    assert float(drift) <= 1e-3 * largest_element, "the sum sent drifted from the sum of the inputs"
    if codec == Compression.INT4:
        assert residual_element <= 17 / 207 * largest_element * (1 + 1e-5)
    elif codec == Compression.INT2:
        assert residual_element <= largest_element * (1 + 1e-5)
    else:
        factor = math.sqrt(1 - 0.02) / (1 - math.sqrt(1 - 0.02))
        assert max(norms) <= factor * largest_norm
    assert max(norms[500:]) <= 1.25 * max(norms[:500]), "the residual keeps growing"


# --------------------------------------------------------------------------------------------- determinism


DETERMINISM_SCRIPT = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
sys.path.insert(0, sys.argv[2])
from peer.p2p import wire
from tests.p2p.wire_inputs import determinism_inputs
for codec in ("INT4", "INT2", "TOPK2", "TOPK8"):
    for x in determinism_inputs():
        message = wire.encode_bytes(wire.compressed(x, wire.Compression[codec], density=0.03))
        sys.stdout.write(message.hex() + "\\n")
"""


def test_encoding_is_bit_for_bit_the_same_in_another_process():
    here = [wire.encode_bytes(wire.compressed(x, Compression[codec], density=0.03)).hex()
            for codec in ("INT4", "INT2", "TOPK2", "TOPK8") for x in determinism_inputs()]
    for threads in (1, 2):
        result = subprocess.run([sys.executable, "-c", DETERMINISM_SCRIPT, str(threads), str(ROOT)],
                                capture_output=True, check=True, cwd=ROOT, timeout=120)
        assert result.stdout.decode().split() == here


def test_ties_go_to_the_lower_index():
    x = torch.tensor([1.0, -1.0, 1.0, 0.5] * 8)  # 32 elements, chunk 32, density 0.25: k = 8 of 24 tied
    y = wire.roundtrip(x, Compression.TOPK8, density=0.25)
    assert torch.nonzero(y).view(-1).tolist() == [0, 1, 2, 4, 5, 6, 8, 9]
    y = wire.roundtrip(torch.zeros(32), Compression.TOPK2, density=0.25)
    assert torch.equal(y, torch.zeros(32))


# ------------------------------------------------------------------------------------------ hostile encodings


def hostile_cases() -> list[tuple[str, bytearray]]:
    """(what is wrong, message) for each codec: each must be refused with MalformedTensor."""
    cases: list[tuple[str, bytearray]] = []
    x = torch.randn(2 * 64 + 33, generator=torch.Generator().manual_seed(6))  # odd: INT4 pads a nibble
    for codec in NEW:
        _message, header, data = sent(x, codec, 0.1)
        name, shape, codec_id, _offset, nbytes, params = header

        def variant(new_header=None, new_data=None, what="", codec=codec, header=header, data=data):
            cases.append((f"{codec.name}: {what}", forge(new_header or header, data if new_data is None else new_data)))

        variant([name, shape, codec_id, 0, nbytes - 1, params], data[:-1], "truncated by one byte")
        variant([name, shape, codec_id, 0, nbytes + 1, params], data + b"\x00", "one byte too many")
        variant([name, shape, codec_id, 0, nbytes, params], data[:-1], "shorter than its header says")
        variant([name, [shape[0] + 64], codec_id, 0, nbytes, params], data, "shape and length disagree")
        variant([name, shape, codec_id, 0, nbytes, []], data, "no params")
        variant([name, shape, codec_id, 0, nbytes, params + [1]], data, "a param too many")
        variant([name, shape, codec_id, 0, nbytes, [float(p) for p in params]], data, "float params")
        variant([name, shape, codec_id, 0, nbytes, [True] * len(params)], data, "bool params")
        variant([name, shape, codec_id, 0, nbytes, ["64"] * len(params)], data, "string params")
        variant(["int32", shape, codec_id, 0, nbytes, params], data, "a lossy codec on an int tensor")
        for bad_scale, label in ((math.nan, "NaN"), (math.inf, "infinite"), (-1.0, "negative")):
            broken = bytearray(data)
            broken[0:4] = struct.pack("<f", bad_scale)
            variant(new_data=bytes(broken), what=f"{label} scale")
        if codec in (Compression.INT4, Compression.INT2):
            variant([name, shape, codec_id, 0, nbytes, [0]], data, "block 0")
            variant([name, shape, codec_id, 0, nbytes, [2**21]], data, "oversized block")
            variant([name, shape, codec_id, 0, nbytes, [32]], data, "another block size: the lengths disagree")
        if codec == Compression.INT4:
            broken = bytearray(data)
            broken[-1] |= 0xF0  # the padding nibble of an odd count
            variant(new_data=bytes(broken), what="padding nibble set")
            broken = bytearray(data)
            broken[-2] = 0x88  # code -8
            variant(new_data=bytes(broken), what="code -8")
        if codec in (Compression.INT2, Compression.TOPK2):
            count = x.numel() if codec == Compression.INT2 else None
            if count is None:
                kept = sum(rows * kk for _, rows, _, kk in wire._topk_parts(x.numel(), *params))
                count = kept
            if count % 4:
                broken = bytearray(data)
                broken[-1] |= 0xC0
                variant(new_data=bytes(broken), what="padding code set")
            broken = bytearray(data)
            broken[0:8] = struct.pack("<ff", 2.0, 1.0)
            variant(new_data=bytes(broken), what="lower level above the upper one")
        if codec in TOPK:
            chunk, k = params
            variant([name, shape, codec_id, 0, nbytes, [chunk, chunk + 1]], data, "k above chunk")
            variant([name, shape, codec_id, 0, nbytes, [chunk, 0]], data, "k = 0")
            variant([name, shape, codec_id, 0, nbytes, [2**17, 1]], data, "chunk beyond 16-bit indices")
            variant([name, shape, codec_id, 0, nbytes, [chunk, k * 10**6]], data, "oversized count")
            scale_bytes = 4 * (2 if codec == Compression.TOPK2 else 1)  # one chunk: the tensor is 161 elements
            low, high = wire._elias_fano(chunk, k)
            index_bytes = sum(wire._indices_nbytes(1, chunk, k))
            largest = ((((chunk - 1) >> low) + 1) << low) + (1 << low) - 1  # the top of the high vector's range

            def with_indices(new: list[int], what: str, chunk=chunk, data=data, start=scale_bytes,
                             end=scale_bytes + index_bytes, variant=variant) -> None:
                packed = bytes(wire._pack_indices(torch.tensor([new]), chunk).tolist())
                variant(new_data=data[:start] + packed + data[end:], what=what)

            spaced = [i << low for i in range(k)]  # valid and increasing: one index per high part
            with_indices(spaced[:-1] + [x.numel()], "index past the end")
            with_indices(spaced[:-1] + [largest], "index past the chunk (the largest the code can say)")
            with_indices(spaced[:-1] + [spaced[-2]], "duplicate index")
            with_indices(spaced[:-2] + [spaced[-2] + 1, spaced[-2]], "indices out of order (in one high part)")
            high_bytes = -(-high // 8)
            for position, what in ((high - 1, "a high bit vector with a bit too many"),
                                   (None, "a high bit vector with a bit too few")):
                bits = [int(b) for b in wire._unpack_codes(torch.frombuffer(bytearray(data[scale_bytes:][:high_bytes]),
                                                                            dtype=torch.uint8), 1, high)]
                if position is None:
                    bits[bits.index(1)] = 0
                else:
                    bits[bits.index(0, bits.index(1))] = 1
                packed = bytes(wire._pack_codes(torch.tensor(bits, dtype=torch.uint8), 1).tolist())
                variant(new_data=data[:scale_bytes] + packed + data[scale_bytes + high_bytes:], what=what)
            if high % 8:
                broken = bytearray(data)
                broken[scale_bytes + high_bytes - 1] |= 0x80
                variant(new_data=bytes(broken), what="high bit vector padding set")
            if (k * low) % 8:
                broken = bytearray(data)
                broken[scale_bytes + index_bytes - 1] |= 0x80
                variant(new_data=bytes(broken), what="low bits padding set")
        if codec == Compression.TOPK8:
            broken = bytearray(data)
            broken[-1] = 0x80  # -128
            variant(new_data=bytes(broken), what="value -128")
    return cases


HOSTILE = hostile_cases()


@pytest.mark.parametrize("message", [message for _, message in HOSTILE], ids=[what for what, _ in HOSTILE])
def test_hostile_encodings_are_refused_with_malformed_tensor(message):
    with pytest.raises(MalformedTensor):
        wire.decode(message)
    with pytest.raises(MalformedTensor):
        wire.decode(bytes(message))  # read-only buffer: the copying path


def test_hostile_cases_differ_from_a_valid_message_in_one_thing_only():
    x = torch.randn(2 * 64 + 33, generator=torch.Generator().manual_seed(6))
    for codec in NEW:
        _message, header, data = sent(x, codec, 0.1)
        assert torch.equal(wire.decode(forge(header, data)), wire.roundtrip(x, codec, density=0.1))


@st.composite
def flipped_messages(draw):
    codec = draw(st.sampled_from(NEW))
    x = draw(pseudo_gradients(max_size=300))
    message, header, data = sent(x, codec, draw(st.sampled_from([0.05, 0.5])))
    if not data:
        return codec, header, bytearray(message)
    broken = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(broken) - 1))
        broken[position] ^= 1 << draw(st.integers(0, 7))
    return codec, header, forge(header, bytes(broken))


@settings(max_examples=max(200, settings.default.max_examples))
@given(flipped_messages())
def test_flipped_bits_are_refused_or_decode_to_a_tensor_of_the_header_shape(case):
    _codec, header, message = case
    try:
        decoded = wire.decode(message)
    except MalformedTensor:
        return
    name, shape, *_ = header
    assert decoded.dtype == wire.DTYPES[name] and list(decoded.shape) == shape


@given(st.sampled_from(NEW), st.lists(st.integers(-3, 2**40) | st.floats() | st.none() | st.text(max_size=3),
                                      max_size=3), st.integers(-5, 5000))
def test_arbitrary_params_and_lengths_never_raise_anything_but_malformed_tensor(codec, params, nbytes):
    data = bytes(range(256)) * (max(0, nbytes) // 256 + 1)
    message = forge(["float32", [321], int(codec), 0, nbytes, params], data[:max(0, nbytes)])
    try:
        decoded = wire.decode(message)
    except MalformedTensor:
        return
    assert decoded.shape == (321,) and decoded.dtype == torch.float32


# --------------------------------------------------------------------------------------------------- over RPC


async def test_a_call_carrying_a_hostile_tensor_fails_alone_and_the_connection_keeps_serving(autojump_clock):
    swarm = Swarmlet("memory")
    async with swarm.peer("b") as b, swarm.peer("a") as a:
        channel = await hand_rolled.handshake(await raw_connect(swarm, b.address))
        x = torch.randn(5000, generator=torch.Generator().manual_seed(8))
        for stream_id, (what, message) in zip(range(1, 2 * len(HOSTILE), 2), HOSTILE):
            # the same hostile tensor as the argument of a call to "echo"
            (body_len,) = struct.unpack_from("<I", message)
            tensor = msgpack.unpackb(bytes(message[4:4 + body_len]), ext_hook=msgpack.ExtType)
            body = msgpack.packb(["echo", 5.0, [tensor]], use_bin_type=True)
            head = struct.pack("<I", len(body)) + body
            data_start = -(-(4 + body_len) // ALIGNMENT) * ALIGNMENT
            data = bytes(message[data_start:])
            parts = [head + (bytes(-len(head) % ALIGNMENT) + data if data else b"")]
            reply = await send_raw_request(channel, stream_id, parts)
            assert reply[0] == 1 and reply[1] == BadRequest.code, (what, reply)
        # the same connection still serves a well-formed call, with a top-k tensor
        good = wire.encode(["echo", 5.0, [wire.compressed(x, Compression.TOPK2)]])
        reply = await send_raw_request(channel, 2 * len(HOSTILE) + 1, good)
        assert reply[0] == 0 and torch.equal(reply[1][0], wire.roundtrip(x, Compression.TOPK2))
        # and ordinary nodes call each other with every new codec
        for codec in NEW:
            with trio.fail_after(10):
                echoed = await a.call(b.address, "echo", [wire.compressed(x, codec)], timeout=5)
            assert torch.equal(echoed[0], wire.roundtrip(x, codec))
        assert b.stats["calls_received"] >= len(HOSTILE)


def test_sparse_tensors_cannot_expand_a_small_message_past_max_decoded_bytes():
    """A top-k chunk of 65536 elements keeping one takes 13 bytes: without a bound on what a message decodes to,
    a few kilobytes would ask for gigabytes. The bound is checked from each header, before that tensor is made,
    so what a refused message made stays within it."""
    numel = 1 << 20
    one = torch.zeros(numel)
    one[5] = 1.0
    with chunk_size(65536):
        message = wire.encode_bytes([wire.compressed(one, Compression.TOPK8, density=1 / 65536)] * 40)
    assert len(message) < 40 * 16 * 13 + 4096
    limits = wire.Limits(max_decoded_bytes=39 * 4 * numel)
    made = []
    original = torch.zeros
    torch.zeros = lambda *a, **k: made.append(a) or original(*a, **k)
    try:
        with pytest.raises(wire.LimitExceeded):
            wire.decode(message, limits=limits)
    finally:
        torch.zeros = original
    assert len(made) == 39  # the 40th was refused from its header
    decoded = wire.decode(message, limits=wire.Limits(max_decoded_bytes=40 * 4 * numel))
    assert len(decoded) == 40 and torch.equal(decoded[0], one)


@pytest.mark.parametrize("codec", [Compression.INT8] + NEW, ids=lambda c: c.name)
def test_a_finite_float16_tensor_never_decodes_to_infinity(codec):
    """A block scale rounded up puts the top level past float16's largest finite value (INT8: 64 * 1024 =
    65536 for 65504): decoded values are clamped to the dtype's finite range."""
    x = torch.tensor([65504.0, -65504.0, 1.0, 60000.0] * 20, dtype=torch.float16)
    y = wire.roundtrip(x, codec, density=0.5)
    assert bool(torch.isfinite(y).all())
    if codec not in TOPK:  # (the top-k codecs drop half of it)
        assert float((y.float() - x.float()).abs().max()) <= 65504 / 127 * 16
    assert torch.equal(wire.roundtrip(y, codec, density=0.5), y)
