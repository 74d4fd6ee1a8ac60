"""The state's content hash and manifest (averaging.state_hash): what the verified state download rests on."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from averaging.state_hash import (
    BLOCK_BYTES,
    Manifest,
    ManifestError,
    segments_of,
    state_digest,
    state_manifest,
)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8,
          torch.bool]


@st.composite
def states(draw, max_tensors=4, max_elements=40):
    """A list of small tensors of mixed dtypes and shapes (0-d and empty ones included), with random bytes."""
    tensors = []
    for _ in range(draw(st.integers(0, max_tensors))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        numel = 1
        for d in shape:
            numel *= d
        if numel > max_elements:
            shape, numel = [numel % max_elements], numel % max_elements
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
        tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        if dtype == torch.bool:
            tensor = tensor % 2
        tensors.append(tensor.view(dtype).reshape(shape).clone())
    return tensors


def raw_bytes(tensors):
    return b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def reference_root(tensors, block_bytes):
    """The definition, written out the slow way: join every byte, cut into blocks, hash the header and digests."""
    data = raw_bytes(tensors)
    blocks = [data[i:i + block_bytes] for i in range(0, len(data), block_bytes)]
    header = ";".join(["swarmd.state.v1", str(block_bytes)] + [
        f"{str(t.dtype).removeprefix('torch.')}:{','.join(str(d) for d in t.shape)}" for t in tensors]) + ";"
    root = hashlib.sha256(len(header).to_bytes(8, "little") + header.encode())
    for block in blocks:
        root.update(hashlib.sha256(block).digest())
    return root.hexdigest()[:32], [hashlib.sha256(b).digest() for b in blocks]


@given(states(), st.integers(1, 64))
def test_the_manifest_follows_the_definition_across_tensor_boundaries(tensors, block_bytes):
    manifest = state_manifest(tensors, block_bytes)
    root, digests = reference_root(tensors, block_bytes)
    assert manifest.root == root
    assert list(manifest.digests) == digests
    data = raw_bytes(tensors)
    assert manifest.total_bytes == len(data)
    # each block's segments, read out of the tensors, are exactly that block's bytes
    views = [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    for index in range(manifest.num_blocks):
        start, end = manifest.block_range(index)
        pieces = [views[t][a:b] for t, a, b in manifest.segments(index)]
        assert b"".join(pieces) == data[start:end]
        assert all(b > a for _, a, b in manifest.segments(index))
        assert manifest.verify_block(index, pieces)
        if end > start:
            flipped = bytearray(data[start:end])
            flipped[-1] ^= 1
            assert not manifest.verify_block(index, [bytes(flipped)])
            assert not manifest.verify_block(index, [data[start:end - 1]])  # a short block
    assert Manifest.from_wire(manifest.to_wire()) == manifest


@given(states(), st.data())
def test_equal_digests_iff_equal_dtypes_shapes_and_bytes(a, data):
    # the other state: a copy, the same bytes under other dtypes/shapes, or an unrelated one
    kind = data.draw(st.sampled_from(["copy", "reinterpreted", "other"]))
    if kind == "copy":
        b = [t.clone() for t in a]
    elif kind == "reinterpreted":
        b = [t.reshape(-1).view(torch.uint8).clone() if t.numel() else t.clone() for t in a]
    else:
        b = data.draw(states())
    same = (len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape for x, y in zip(a, b))
            and raw_bytes(a) == raw_bytes(b))
    assert (state_digest(a) == state_digest(b)) == same
    assert state_digest([t.clone() for t in a]) == state_digest(a)


@given(states(max_elements=20), st.data())
def test_any_flipped_bit_changes_the_digest(tensors, data):
    nonempty = [i for i, t in enumerate(tensors) if t.numel() and t.dtype != torch.bool]
    if not nonempty:
        return
    which = data.draw(st.sampled_from(nonempty))
    changed = [t.clone() for t in tensors]
    flat = changed[which].reshape(-1).view(torch.uint8)
    position = data.draw(st.integers(0, flat.numel() - 1))
    flat[position] ^= 1 << data.draw(st.integers(0, 7))
    assert state_digest(changed) != state_digest(tensors)


def test_the_split_among_tensors_and_the_dtypes_are_part_of_the_digest():
    data = torch.arange(12, dtype=torch.float32)
    assert state_digest([data]) != state_digest([data[:6], data[6:]])
    assert state_digest([data]) != state_digest([data.view(torch.int32)])
    assert state_digest([data]) != state_digest([data.reshape(3, 4)])
    assert state_digest([]) != state_digest([torch.empty(0)])
    assert len(state_digest([data])) == 32 and int(state_digest([data]), 16) >= 0


def test_non_contiguous_tensors_hash_as_their_values():
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    assert state_digest([base.t()]) == state_digest([base.t().contiguous()])
    assert state_digest([base[:, ::2]]) == state_digest([base[:, ::2].clone()])


def test_block_segments_cover_a_range_once():
    assert segments_of([3, 0, 5, 2], 2, 9) == [(0, 2, 3), (2, 0, 5), (3, 0, 1)]
    assert segments_of([3, 5], 3, 8) == [(1, 0, 5)]
    assert segments_of([4], 0, 0) == []


_SUBPROCESS = """
import json, torch
from averaging.state_hash import state_digest, state_manifest
g = torch.Generator().manual_seed(5)
tensors = [torch.randn(1000, 700, generator=g), torch.randint(0, 100, (3, 5), generator=g),
           torch.randn(17, generator=g, dtype=torch.float64).to(torch.bfloat16), torch.tensor(True)]
print(json.dumps([state_digest(tensors), state_manifest(tensors, 4096).root]))
"""


def test_the_digest_is_the_same_in_another_process():
    here = json.loads(subprocess.run([sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True,
                                     check=True, cwd=".").stdout)
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(1000, 700, generator=g), torch.randint(0, 100, (3, 5), generator=g),
               torch.randn(17, generator=g, dtype=torch.float64).to(torch.bfloat16), torch.tensor(True)]
    assert here == [state_digest(tensors), state_manifest(tensors, 4096).root]
    assert state_manifest(tensors).num_blocks == -(-(2_800_000 + 120 + 34 + 1) // BLOCK_BYTES)


def test_a_manifest_from_a_peer_is_checked_against_its_own_root():
    tensors = [torch.arange(5000, dtype=torch.float32), torch.ones(3, dtype=torch.int64)]
    good = state_manifest(tensors, 1024).to_wire()
    assert Manifest.from_wire(good).root == state_manifest(tensors, 1024).root
    lies = [
        {**good, "digests": bytes(32) + good["digests"][32:]},  # a block digest that is not the root's
        {**good, "root": "0" * 32},
        {**good, "tensors": [["float32", [5001]], ["int64", [3]]]},  # more bytes than blocks
        {**good, "tensors": [["float32", [5000]], ["int32", [6]]]},  # the same bytes, another layout
        {**good, "digests": good["digests"][:-32]},
        {**good, "digests": good["digests"] + b"x"},
        {**good, "tensors": [["complex64", [5000]]]},
        {**good, "tensors": [["float32", [-1]]]},
        {**good, "block_bytes": 0},
        {**good, "block_bytes": True},
        {**good, "v": 2},
        {**good, "root": 5},
        [],
        None,
    ]
    for lie in lies:
        with pytest.raises(ManifestError):
            Manifest.from_wire(lie)
