"""Expert bans in the DHT, for `peer status`: which experts trainers banned for lying (`moe.trust`), and why.

A separate module without torch: `peer status` reads the bans and must start without loading torch. Each trainer's
mixture client stores its bans under BANS_KEY with its own PeerID as a signed subkey (only it can write that
entry; a ban is one trainer's local decision, shown with who made it, never merged into a verdict). The DHT
enforces it: an entry under a PeerID subkey signed by any other key is refused by every storing node.
"""

from __future__ import annotations

from typing import Mapping

BANS_KEY = "moe.bans"  # subkey: the banning client's PeerID (signed: only it writes its entry); value: {uid: why}
BANS_TTL = 3600.0  # seconds a published entry lives; a client refreshes it while it runs
MAX_PUBLISHED_BANS = 32
_MAX_REASON = 160


def bans_value(bans: Mapping[str, str]) -> dict[str, str]:
    """What a client publishes: its bans, at most MAX_PUBLISHED_BANS of them (the latest), reasons shortened."""
    latest = list(bans.items())[-MAX_PUBLISHED_BANS:]
    return {uid[:200]: why[:_MAX_REASON] for uid, why in latest}


def parse_bans(entries: Mapping[bytes, object]) -> dict[str, dict[str, str]]:
    """`{uid: {client PeerID hex: why}}` from the subkeys of BANS_KEY's record (subkey -> value); malformed
    entries are skipped (anyone may write a subkey of their own)."""
    banned: dict[str, dict[str, str]] = {}
    for subkey, value in entries.items():
        if not isinstance(subkey, bytes) or not isinstance(value, dict) or len(value) > MAX_PUBLISHED_BANS:
            continue
        for uid, why in value.items():
            if isinstance(uid, str) and isinstance(why, str):
                banned.setdefault(uid[:200], {})[subkey.hex()] = why[:_MAX_REASON]
    return dict(sorted(banned.items()))


__all__ = ["BANS_KEY", "BANS_TTL", "MAX_PUBLISHED_BANS", "bans_value", "parse_bans"]
