"""Moshpit group keys: which DHT key a peer matchmakes under in each round, so that repeated rounds in small
groups reach the global mean.

Peers sit on a virtual grid with `dims` dimensions of `2**bits_per_dim` cells each (`nbits = dims * bits_per_dim`
bits of coordinates; `bits_per_dim = ceil(log2(target_group_size))`). In round r the peer averages along dimension
`d = r mod dims`: its key is the prefix plus every coordinate except the d-th (written as `*`), so its group are the
peers that differ from it only along d. Afterwards each member sets its d-th coordinate to its index in the
(peer-id sorted) group, so next round it meets peers from other groups. With N = g**dims peers all starting at
coordinate zero, rounds 0..dims-1 build a perfect grid and after `dims` rounds every peer holds the exact global
mean (8 peers, groups of 2, 3 bits: 3 rounds): each key of round r holds exactly one member of every group of
round r-1 that shares its coordinates. With other N the scheme still mixes and converges geometrically, because
matchmaking cuts a key's peers into groups in an order salted with the round (`matchmaking.round_salt`): a key
holding more than one group regroups differently every round instead of repeating the same pairs forever (with a
plain peer-id order, such keys freeze into isolated cliques that never reach the global mean).

`nbits = 0` means one key for everyone; the round-salted order alone then does the mixing.

Round bookkeeping (why it is robust): every step advances the round by one whether or not it succeeded, so peers
stepping at the same pace stay in phase even through failed rounds; after a successful round the members also
adopt `max(their rounds) + 1`, which pulls stragglers back in phase. A newcomer takes the round from the peer it
downloads state from (`set_round`).
"""

from __future__ import annotations

from typing import Sequence


def bits_for_group_size(target_group_size: int) -> int:
    """Bits of coordinate per grid dimension: enough to number every member of a full group."""
    if target_group_size < 1:
        raise ValueError("target_group_size must be >= 1")
    return max(1, (target_group_size - 1).bit_length())


class GroupKeyManager:
    """One peer's grid coordinates and round counter; pure state, no I/O."""

    def __init__(
        self,
        prefix: str,
        *,
        target_group_size: int,
        nbits: int = 0,
        coordinates: Sequence[int] | None = None,
        round: int = 0,
    ):
        self.prefix = prefix
        self.bits_per_dim = bits_for_group_size(target_group_size)
        if nbits < 0 or nbits % self.bits_per_dim:
            raise ValueError(f"nbits={nbits} must be a multiple of {self.bits_per_dim} "
                             f"(bits per dimension for groups of {target_group_size})")
        self.dims = nbits // self.bits_per_dim
        self.coordinates = list(coordinates) if coordinates is not None else [0] * self.dims
        if len(self.coordinates) != self.dims:
            raise ValueError(f"{len(self.coordinates)} coordinates for {self.dims} dimensions")
        limit = 1 << self.bits_per_dim
        if any(not 0 <= c < limit for c in self.coordinates):
            raise ValueError(f"coordinates must be in [0, {limit})")
        self.round = round

    @property
    def dimension(self) -> int | None:
        """The grid dimension averaged along in the current round (None with a single key)."""
        return self.round % self.dims if self.dims else None

    @property
    def key(self) -> str:
        """The DHT key for this round's matchmaking."""
        if not self.dims:
            return f"{self.prefix}.averaging"
        dim = self.dimension
        cells = ["*" * self.bits_per_dim if i == dim else format(c, f"0{self.bits_per_dim}b")
                 for i, c in enumerate(self.coordinates)]
        return f"{self.prefix}.averaging.{''.join(cells)}"

    def on_group(self, sorted_peer_ids: Sequence[bytes], my_peer_id: bytes, group_round: int) -> None:
        """After a round that assembled a group: move along the averaged dimension to my index in the group, and
        continue from the group's round (the max of the members' rounds), so the members stay in phase."""
        dimension = self.dimension
        if dimension is not None:
            index = list(sorted_peer_ids).index(my_peer_id)
            self.coordinates[dimension] = index % (1 << self.bits_per_dim)
        self.round = max(self.round, group_round) + 1

    def on_failure(self) -> None:
        """A round without a group still advances, so a peer keeps the swarm's pace (see module docstring)."""
        self.round += 1

    def set_round(self, round: int) -> None:
        """Adopt the swarm's round (a newcomer, from the peer it downloaded state from)."""
        self.round = round
