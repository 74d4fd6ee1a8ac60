"""`peer status`: attach in client mode, ask every live peer for its stats, and show the swarm.

Peers come from the directory in the DHT (`peer.directory`); each is asked `peer.status` in parallel with a short
deadline, so one dead or slow peer shows up as unreachable instead of stalling the report.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Awaitable, Callable

import trio

from dht.client import DHTClient
from dht.records import signed_by_subkey
from moe.bans import BANS_KEY, parse_bans
from peer.directory import PeerEntry, list_peers
from peer.p2p.budget import describe_usage
from peer.p2p.identity import PeerID
from peer.p2p.relay import show_address
from peer.p2p.rpc import RPCError, RPCNode

STATUS_METHOD = "peer.status"
MAX_REPLICA_KEYS = 64  # DHT keys one `peer.status` call may ask the replicas of (peer.daemon.Daemon.replicas_held)
RunsReader = Callable[[Any], Awaitable[list[dict[str, Any]]]]
# RPCNode.stats counters of calls this peer served that failed, and of its own calls that failed. Every error reply
# (a call refused before any handler ran, a typed refusal, a crashed handler) counts once in `error_replies`;
# `handler_errors` / `handler_failures` say which kind it was and are not added again. A handler cut off by the
# caller's deadline or cancellation sends no reply: `handlers_cancelled`.
SERVED_FAILURES = ("error_replies", "handlers_cancelled")
SENT_FAILURES = ("calls_failed",)


def failed_calls(rpc_stats: dict[str, Any] | None) -> dict[str, int] | None:
    """{"served": ..., "sent": ..., "total": ...} from a peer's RPC stats (None when it did not answer).

    Why both directions: a volunteer mostly serves (expert calls from trainers: a bad input, a missing expert, a
    caller's deadline passing during a slow forward all fail there), and rarely calls out itself."""
    if not isinstance(rpc_stats, dict):
        return None

    def count(keys: tuple[str, ...]) -> int:
        return sum(int(rpc_stats.get(key) or 0) for key in keys)

    served, sent = count(SERVED_FAILURES), count(SENT_FAILURES)
    return {"served": served, "sent": sent, "total": served + sent}


def plural(count: int, noun: str, plural_noun: str | None = None) -> str:
    """'1 peer', '2 peers', '0 peers'."""
    return f"{count} {noun if count == 1 else plural_noun or noun + 's'}"


async def gather_status(rpc: RPCNode, dht: DHTClient, *, timeout: float = 3.0,
                        runs_reader: RunsReader | None = None,
                        entries: list[PeerEntry] | None = None, replicas: list[str] | None = None,
                        read_bans: bool = False) -> dict[str, Any]:
    """One `peer.status` call per peer of `entries` (read from the directory when None: the dashboard passes the
    listing it keeps, so a refresh costs one call per peer). With `replicas` (DHT keys) each peer also returns
    the records it holds for them; the answer then has "replicas": one {key: encoded record} per peer. With
    `read_bans`, "bans": the experts trainers banned for lying (`moe.trust`), {uid: {trainer PeerID: why}}."""
    if entries is None:
        entries = await list_peers(dht)
    replies: dict[str, dict[str, Any]] = {}

    async def ask(entry: PeerEntry) -> None:
        try:
            args = {"replicas": replicas} if replicas is not None else None
            replies[entry.peer_id] = await rpc.call(entry.address, STATUS_METHOD, args, timeout=timeout,
                                                    peer_id=PeerID.from_hex(entry.peer_id))
        except RPCError as error:
            replies[entry.peer_id] = {"error": str(error)}

    async with trio.open_nursery() as nursery:
        for entry in entries:
            nursery.start_soon(ask, entry)

    peers = []
    experts_by_prefix: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in entries:
        reply = replies.get(entry.peer_id, {})
        reachable = "error" not in reply
        experts = reply.get("expert_uids", []) if reachable else []
        served = (reply.get("experts") or {}).get("requests_total", 0) if reachable else 0
        peers.append({
            "peer_id": entry.peer_id,
            "address": show_address(entry.address),
            "reachable": reachable,
            "error": reply.get("error"),
            "uptime_s": reply.get("uptime_s"),
            "version": reply.get("version"),
            "bytes_sent": (reply.get("rpc") or {}).get("bytes_sent"),
            "bytes_received": (reply.get("rpc") or {}).get("bytes_received"),
            "expert_requests": {uid: sum((stats.get("requests") or {}).values()) for uid, stats in
                                ((reply.get("experts") or {}).get("per_expert") or {}).items()},
            "dht_table_size": (reply.get("dht") or {}).get("routing_table_size"),
            "dht_rebootstraps": (reply.get("dht") or {}).get("rebootstraps"),
            "experts": experts,
            "expert_kind": reply.get("expert_kind") if experts else None,  # relu_ffn@3072, gpt2_ffn@64...
            "hidden_dim": reply.get("hidden_dim") if experts else None,
            "requests_served": served,
            "failures_seen": (failed_calls(reply.get("rpc")) or {}).get("total"),
            "failed_calls": failed_calls(reply.get("rpc")),
            "averaging_rounds": (reply.get("averaging") or {}).get("rounds"),
            "averaging_failures": (reply.get("averaging") or {}).get("failures"),
            "last_group_size": (reply.get("averaging") or {}).get("last_group_size"),
            # public / private and how it is reached (direct, relay); its connections: direct, upgraded by a hole
            # punch, relayed (the punch failed)
            "reachability": (reply.get("reachability") or {}).get("status"),
            "reached": (reply.get("reachability") or {}).get("how"),
            "connections": (reply.get("relay") or {}).get("connections"),
            "relays": (reply.get("relay") or {}).get("relays"),  # a private peer's relays (PeerIDs)
            # use against each resource limit (issue 40), and that in one line
            "budgets": reply.get("budgets") if reachable else None,
            "budget": describe_usage(reply["budgets"]) if reachable and reply.get("budgets") else None,
        })
        for uid in experts:
            prefix = uid.split(".")[0]
            experts_by_prefix[prefix].append({"uid": uid, "peer_id": entry.peer_id,
                                              "address": show_address(entry.address),
                                              "kind": reply.get("expert_kind"), "hidden_dim": reply.get("hidden_dim")})
    runs = await runs_reader(dht) if runs_reader is not None else []
    extra: dict[str, Any] = {}
    if read_bans:
        extra["bans"] = await read_expert_bans(dht)
    if replicas is not None:
        extra["replicas"] = [reply["replicas"] for reply in replies.values()
                             if isinstance(reply.get("replicas"), dict)]
    return {
        **extra,
        "peers": peers,
        "peers_reachable": sum(p["reachable"] for p in peers),
        "experts": {prefix: sorted(items, key=lambda item: item["uid"]) for prefix, items in
                    sorted(experts_by_prefix.items())},
        "runs": runs,
    }


async def read_expert_bans(dht: DHTClient) -> dict[str, dict[str, str]]:
    """The bans every trainer published (moe.mixture publishes its client's under `moe.bans.BANS_KEY`)."""
    record = await dht.get(BANS_KEY, latest=True)
    subkeys = getattr(record, "subkeys", None) or {}
    return parse_bans({subkey: entry.value for subkey, entry in subkeys.items() if signed_by_subkey(subkey, entry)})


def format_status(status: dict[str, Any]) -> str:
    lines = [f"peers: {status['peers_reachable']} reachable of {len(status['peers'])} in the directory", ""]
    header = (f"{'PEER':<14}{'ADDRESS':<24}{'STATE':<13}{'UPTIME':>8}{'DHT':>6}{'EXPERTS':>9}{'SERVED':>9}"
              f"{'FAILED':>8}{'AVG':>6}")
    lines.append(header)
    for peer in status["peers"]:
        state = "ok" if peer["reachable"] else "unreachable"
        uptime = f"{peer['uptime_s']:.0f}s" if peer["uptime_s"] is not None else "-"
        table = peer["dht_table_size"] if peer["dht_table_size"] is not None else "-"
        failed = peer["failures_seen"] if peer["failures_seen"] is not None else "-"
        rounds = peer["averaging_rounds"] if peer["averaging_rounds"] is not None else "-"
        lines.append(f"{peer['peer_id'][:12]:<14}{peer['address']:<24}{state:<13}{uptime:>8}{table!s:>6}"
                     f"{len(peer['experts']):>9}{peer['requests_served']:>9}{failed!s:>8}{rounds!s:>6}")
    counted = [peer["connections"] for peer in status["peers"] if peer.get("connections")]
    if counted:
        private = sum(peer.get("reachability") == "private" for peer in status["peers"])
        total = {key: sum(c.get(key, 0) for c in counted) for key in ("direct", "upgraded", "relayed")}
        lines.append(f"connections: {total['direct']} direct, {total['upgraded']} upgraded by hole punching, "
                     f"{total['relayed']} relayed ({plural(private, 'private peer')})")
    budgets = [(peer["peer_id"], peer["budget"]) for peer in status["peers"] if peer.get("budget")]
    if budgets:
        lines.append("")
        lines.append("budgets (the limit nearest to full on each peer, and what it refused):")
        lines += [f"  {peer_id[:12]}: {line}" for peer_id, line in budgets]
    lines.append("")
    if status["experts"]:
        lines.append("experts by prefix:")
        for prefix, items in status["experts"].items():
            hosts = sorted({item["address"] for item in items})
            kinds = sorted({f"{item.get('kind') or '?'}, hidden {item.get('hidden_dim') or '?'}" for item in items})
            lines.append(f"  {prefix}: {plural(len(items), 'expert')} on {plural(len(hosts), 'peer')} "
                         f"({', '.join(hosts)}), {'; '.join(kinds)}")
    else:
        lines.append("experts: none declared")
    if status.get("bans"):
        lines.append("")
        lines.append("experts banned for lying (outlier replies):")
        for uid, by in status["bans"].items():
            why = next(iter(by.values()))
            lines.append(f"  {uid}: banned by {plural(len(by), 'trainer')} ({why})")
    if status["runs"]:
        lines.append("")
        lines.append("training runs:")
        for run in status["runs"]:
            lines.append(f"  {run['run_id']}: epoch {run['epoch']}, {plural(run['trainers'], 'trainer')} "
                         f"({run['trainers_in_epoch']} in this epoch), {run['samples']}/{run['target_batch_size']} "
                         f"samples, {run['samples_per_s']} samples/s")
            if run.get("algorithm", "collaborative") != "collaborative":
                utilization = run.get("utilization")
                lines.append(f"    algorithm {run['algorithm']}: outer step {run.get('outer_step')}, "
                             f"{run.get('bytes_per_outer_step')} bytes per outer step, utilization "
                             f"{'?' if utilization is None else utilization}, outer hashes "
                             f"{'agree' if run.get('hashes_agree') else 'DIFFER'}")
                if run.get("round_members") is not None:
                    window = run.get("grace_window")
                    joined = run.get("joiner_first_contribution")
                    lines.append(f"    last round: {plural(run['round_members'], 'member')} "
                                 f"({run.get('round_started') or '?'}), grace window "
                                 f"{'?' if window is None else f'{window:.3f} s'}, "
                                 f"{plural(run.get('late_contributions', 0), 'late contribution')}"
                                 + ("" if joined is None else f", first contributions within {joined} outer steps"))
            else:
                lines.append("    algorithm collaborative")
            for group in run.get("recent_groups", []):
                lines.append(f"    averaged together: {', '.join(group)}")
    return "\n".join(lines)


def to_json(status: dict[str, Any]) -> str:
    return json.dumps(status, indent=2, sort_keys=True, default=str)
