"""What an expert call must pass before it reaches the runtime: the decoding and checking half of the handlers of
`moe.server.ExpertServer`.

Why a module of its own: every call to an expert server comes from the network and may be anything; before a
single row reaches an expert, the server must know which expert it names, that its tensors fit the expert's
schema (shape, dtype, rows), that they are finite, that they are not absurdly larger than what the expert
usually gets (running statistics of its accepted requests, `moe.trust.NormStats`), and which codec the caller
wants its reply in. That is one job, with the statistics as its only state; running the experts, keeping their
graphs and encoding the replies stay in the server. A refusal is a typed `RemoteError` the caller can act on
(`BadExpertInput`, `ExpertNotFound`), counted in the server's error counters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moe.errors import BadExpertInput, ExpertNotFound
from moe.experts import Expert
from moe.schema import SchemaError, validate_batch
from moe.trust import NormStats, typical_norm
from peer.p2p import wire
from peer.p2p.rpc import RemoteError


@dataclass
class PackedCall:
    """A packed call (several experts' rows in one tensor per input and gradient, see `moe.calls`) as decoded:
    `experts[i]` serves `rows[i]` rows of the packed tensors (None: not on this server); `reference` is the first
    expert found, whose schema the packed tensors were checked against (the others must share it); `packed`:
    "inputs" (and, for a backward, "grad_outputs") as received; `errors`: position -> why that expert fails
    alone."""

    uids: list[str]
    rows: list[int]
    codec: wire.Compression
    groups: tuple[str, ...]
    experts: list[Expert | None]
    reference: Expert | None
    packed: dict[str, list[torch.Tensor]]
    errors: dict[int, RemoteError]

    @property
    def total(self) -> int:
        return sum(self.rows)


class CallChecker:
    """Decodes and checks the calls to the `experts` of one server (uid -> expert). `max_batch_size`: the most
    rows one expert takes in one call; `max_norm_ratio`: how many times larger than an expert's usual inputs or
    gradients a request may be (None: no check); `errors`: the server's error counters (refusals count as
    "bad_input" or "not_found")."""

    def __init__(self, experts: Mapping[str, Expert], *, max_batch_size: int, max_norm_ratio: float | None,
                 errors: dict[str, int]) -> None:
        self.experts = experts
        self.max_batch_size = max_batch_size
        self.max_norm_ratio = max_norm_ratio
        self.errors = errors
        # per expert uid: running statistics of each input tensor's and each gradient tensor's size
        self.norms: dict[str, dict[str, list[NormStats]]] = {
            uid: {"inputs": [NormStats() for _ in e.inputs], "grad_outputs": [NormStats() for _ in e.outputs]}
            for uid, e in experts.items()}

    def expert_for(self, args: Any) -> Expert:
        if not isinstance(args, dict) or not isinstance(args.get("uid"), str):
            self.errors["bad_input"] += 1
            raise BadExpertInput("expected arguments {'uid': str, ...}")
        expert = self.experts.get(args["uid"])
        if expert is None:
            self.errors["not_found"] += 1
            raise ExpertNotFound(f"no expert {args['uid'][:100]!r} on this server")
        return expert

    def validate(self, expert: Expert, args: dict[str, Any], *, backward: bool
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        try:
            rows = validate_batch(expert.inputs, args.get("inputs"), max_batch_size=self.max_batch_size)
            grads: list[torch.Tensor] = []
            if backward:
                validate_batch(expert.outputs, args.get("grad_outputs"), max_batch_size=self.max_batch_size,
                               batch_size=rows, what="grad_outputs")
                grads = list(args["grad_outputs"])
        except SchemaError as error:
            self.errors["bad_input"] += 1
            raise BadExpertInput(f"{expert.uid}: {error}") from None
        inputs = list(args["inputs"])
        if self.max_norm_ratio is not None:
            self.check_norms(expert, {"inputs": inputs, "grad_outputs": grads})
        return inputs, grads

    def check_norms(self, expert: Expert, tensors: dict[str, list[torch.Tensor]]) -> None:
        """Refuse inputs or gradients far larger than this expert usually gets: finite values can still be
        1e30 and wreck a step (gradient clipping bounds the step, but the request is garbage either way). Only
        accepted requests update the statistics, so a caller cannot ramp them up in one burst; smaller than
        usual is harmless and accepted."""
        self.admit_norms(expert, [(what, index, typical_norm(tensor)) for what, values in tensors.items()
                                  for index, tensor in enumerate(values) if tensor.is_floating_point()])

    def admit_norms(self, expert: Expert, norms: Sequence[tuple[str, int, float]]) -> None:
        """`check_norms` on norms already measured: (what, index, typical norm) of each floating tensor."""
        assert self.max_norm_ratio is not None
        measured: list[tuple[NormStats, float]] = []
        for what, index, norm in norms:
            stats = self.norms[expert.uid][what][index]
            ratio = stats.ratio(norm)
            if ratio > self.max_norm_ratio:
                self.errors["bad_input"] += 1
                raise BadExpertInput(f"{expert.uid}: {what}[{index}] norm {norm:.3g} is {ratio:.3g}x this "
                                     f"expert's usual {stats.typical():.3g} (at most {self.max_norm_ratio:g}x)")
            measured.append((stats, norm))
        for stats, norm in measured:
            stats.observe(norm)

    def codec(self, args: Any) -> wire.Compression:
        """The codec the caller asked replies in (`"compression": 1` = float16, `2` = 8-bit; default none)."""
        compression = args.get("compression", 0) if isinstance(args, dict) else 0
        if compression not in wire.Compression._value2member_map_ or isinstance(compression, bool):
            self.errors["bad_input"] += 1
            raise BadExpertInput(f"unknown compression {compression!r}")
        return wire.Compression(compression)

    def entries(self, args: Any) -> list[Any]:
        """The entries of a call in the per-expert batched form (`{"experts": [{"uid", "inputs", ...}]}`), each
        expert at most once; each entry is checked alone later (`expert_for`, `validate`)."""
        entries = args.get("experts") if isinstance(args, dict) else None
        if not isinstance(entries, list) or not entries:
            self.errors["bad_input"] += 1
            raise BadExpertInput("expected arguments {'experts': [{'uid': str, ...}, ...]}")
        uids = [entry.get("uid") if isinstance(entry, dict) else None for entry in entries]
        named = [uid for uid in uids if isinstance(uid, str)]
        if len(entries) > len(self.experts) or len(set(named)) != len(named):
            self.errors["bad_input"] += 1
            raise BadExpertInput(f"{len(entries)} entries: each of this server's {len(self.experts)} experts at "
                                 f"most once per call")
        return entries

    def packed(self, args: dict[str, Any], *, backward: bool) -> PackedCall:
        """Decode a packed call and check its shape as a whole, once, against the first expert's schema. Raises
        BadExpertInput for a call that is malformed as a whole; an unknown expert, or one whose schema differs,
        fails alone (in `errors`). Finiteness and norms are `screen`'s."""
        uids, rows = args.get("uids"), args.get("rows")
        if (not isinstance(uids, list) or not isinstance(rows, list) or not uids or len(uids) != len(rows)
                or not all(isinstance(uid, str) for uid in uids)
                or not all(isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= self.max_batch_size
                           for r in rows)):
            self.errors["bad_input"] += 1
            raise BadExpertInput(f"expected arguments {{'uids': [str], 'rows': [1..{self.max_batch_size}], "
                                 f"'inputs': [tensor], ...}} with one row count per uid")
        if len(uids) > len(self.experts) or len(set(uids)) != len(uids):
            self.errors["bad_input"] += 1
            raise BadExpertInput(f"{len(uids)} entries: each of this server's {len(self.experts)} experts at "
                                 f"most once per call")
        codec = self.codec(args)
        errors: dict[int, RemoteError] = {}
        experts: list[Expert | None] = []
        for position, uid in enumerate(uids):
            expert = self.experts.get(uid)
            if expert is None:
                self.errors["not_found"] += 1
                errors[position] = ExpertNotFound(f"no expert {uid[:100]!r} on this server")
            experts.append(expert)
        reference = next((e for e in experts if e is not None), None)
        total = sum(rows)
        groups = ("inputs", "grad_outputs") if backward else ("inputs",)
        packed: dict[str, list[torch.Tensor]] = {}
        if reference is not None:
            try:
                for what, specs in zip(groups, (reference.inputs, reference.outputs)):
                    validate_batch(specs, args.get(what), max_batch_size=total, batch_size=total, what=what,
                                   finite=False)
                    packed[what] = list(args[what])
            except SchemaError as error:
                self.errors["bad_input"] += 1
                raise BadExpertInput(f"{reference.uid} and {len(uids) - 1} more: {error}") from None
            for position, expert in enumerate(experts):
                if expert is not None and position not in errors and (
                        expert.inputs != reference.inputs or expert.outputs != reference.outputs):
                    self.errors["bad_input"] += 1
                    errors[position] = BadExpertInput(f"{expert.uid}: its schema differs from {reference.uid}'s: "
                                                      f"call it alone")
        return PackedCall(uids, rows, codec, groups, experts, reference, packed, errors)

    def screen(self, call: PackedCall) -> None:
        """The per-expert checks of a packed call, each in one pass over the packed tensors: finiteness, then
        (with `max_norm_ratio`) each expert's typical norm (RMS of its row norms) against its statistics. Only
        what fails a check is looked at expert by expert, and that expert alone fails (in `call.errors`)."""
        uids, rows, total, errors, experts = call.uids, call.rows, call.total, call.errors, call.experts
        owner = torch.repeat_interleave(torch.arange(len(uids)), torch.tensor(rows))
        for what, tensors in call.packed.items():
            for index, tensor in enumerate(tensors):
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    flat = torch.isfinite(tensor.reshape(total, -1)).all(dim=1)
                    for position in torch.unique(owner[~flat]).tolist():
                        if position not in errors:
                            self.errors["bad_input"] += 1
                            errors[position] = BadExpertInput(f"{uids[position]}: {what}[{index}]: contains NaN "
                                                              f"or infinite values")
        if self.max_norm_ratio is not None and call.packed:
            # one row-norm pass per tensor, summed per expert: each expert's typical norm (RMS of its row norms)
            norms: list[list[tuple[str, int, float]]] = [[] for _ in uids]
            for what, tensors in call.packed.items():
                for index, tensor in enumerate(tensors):
                    if not tensor.is_floating_point():
                        continue
                    squares = tensor.detach().reshape(total, -1).double().square().sum(dim=1)
                    per_expert = torch.zeros(len(uids), dtype=torch.float64).index_add_(0, owner, squares)
                    rms = (per_expert / torch.tensor(rows, dtype=torch.float64)).sqrt().tolist()
                    for position, norm in enumerate(rms):
                        norms[position].append((what, index, norm))
            for position, expert in enumerate(experts):
                if expert is not None and position not in errors:
                    try:
                        self.admit_norms(expert, norms[position])
                    except BadExpertInput as refused:
                        errors[position] = refused
