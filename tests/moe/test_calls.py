"""moe.calls: the one call path to expert servers (method names, codec, reply checks, failure mapping)."""

from __future__ import annotations

import pytest
import torch

from moe import calls
from moe.errors import BadExpertOutput
from moe.experts import ExpertKind, make_expert, register_expert_kind
from moe.remote_expert import RemoteExpert
from moe.schema import TensorSpec
from peer.p2p import wire
from peer.p2p.rpc import CallTimeout, ConnectionFailed, RemoteError
from tests.moe.bad_experts import AnswersInf

register_expert_kind(ExpertKind("test_calls_inf", lambda h, **o: AnswersInf(h), lambda h, **o: [TensorSpec((h,))]),
                     replace=True)


@pytest.mark.parametrize("reply, kwargs, why", [
    ({"outputs": [torch.ones(2, 3)], "extra": 1}, {"count": 2}, "1 outputs, expected 2"),
    ({"outputs": torch.ones(2, 3)}, {}, "expected {'outputs'"),
    ("outputs", {}, "expected {'outputs'"),
    ({"outputs": [torch.ones(2, 3)]}, {"rows": 3}, "for 3 samples"),
    ({"outputs": [torch.ones(2, 3)]}, {"shapes": [(2, 4)]}, "expected (2, 4)"),
    ({"outputs": [torch.ones(2, 3, dtype=torch.int64)]}, {"floating": True}, "floating point"),
    ({"outputs": [torch.tensor([[1.0, float("nan")]])]}, {}, "NaN or infinite"),
    ({"outputs": [torch.tensor([[1.0, float("-inf")]], dtype=torch.float16)]}, {}, "NaN or infinite"),
])
def test_reply_check_rejects_what_does_not_fit(reply, kwargs, why):
    with pytest.raises(BadExpertOutput, match=why.replace("(", r"\(").replace(")", r"\)")) as caught:
        calls.reply_tensors(reply, "outputs", "ffn.1", **kwargs)
    assert caught.value.uid == "ffn.1"


def test_reply_check_accepts_a_fitting_reply():
    good = [torch.ones(2, 3), torch.zeros(2, dtype=torch.int64)]
    assert calls.reply_tensors({"outputs": good}, "outputs", "ffn.1", count=2, rows=2) is good


def test_failures_are_mapped_in_one_place():
    assert calls.peer_unreachable(ConnectionFailed("refused"))
    assert not calls.peer_unreachable(CallTimeout("slow"))
    assert not calls.peer_unreachable(BadExpertOutput("ffn.1", "NaN"))
    for error in (ConnectionFailed("x"), RemoteError("x"), BadExpertOutput("ffn.1", "x"), wire.WireError("x")):
        assert isinstance(error, calls.CALL_FAILURES)
    assert not isinstance(ValueError("a bug"), calls.CALL_FAILURES)


def test_server_registers_exactly_the_client_method_names():
    import inspect

    from moe import server

    source = inspect.getsource(server.ExpertServer.run)
    names = ("INFO", "FORWARD", "BACKWARD", "FORWARD_BATCH", "BACKWARD_BATCH")
    assert all(f"calls.{name}," in source or f"calls.{name})" in source for name in names)
    assert calls.METHODS == ("moe.info", "moe.forward", "moe.backward", "moe.forward_batch", "moe.backward_batch")


async def test_call_expert_refuses_unknown_methods():
    with pytest.raises(ValueError, match="not an expert server method"):
        await calls.call_expert(None, ("127.0.0.1", 1), None, "moe.nope", {}, timeout=1.0)  # type: ignore[arg-type]


def test_remote_expert_treats_infinite_outputs_as_a_failed_call(harness):
    """Both clients share the reply check: RemoteExpert, like the mixture, refuses non-finite outputs."""
    server = harness.server([make_expert("test_calls_inf.0", "test_calls_inf", 8, seed=0)])
    remote = RemoteExpert("test_calls_inf.0", server.address, harness.client())
    with pytest.raises(BadExpertOutput, match="NaN or infinite"):
        remote(torch.randn(3, 8))
