"""The WAN testbed (peer.testing.wan) is what it says: its measured RTT and throughput between two hosts are
within 10% of each profile, loss is about the profile's, and it leaves nothing behind.

Tolerances are the profile's 10%, not more: the stage runs at a raised priority and its own lateness is checked
too, so these hold with every core busy (docs/testbed.md has the figures, loaded and not).
"""

from __future__ import annotations

import os
import statistics
import subprocess

import pytest

from peer.testing import probe
from peer.testing.wan import PROFILES, WanTestbed, available, link, swarm_profiles

AVAILABLE, WHY_NOT = available()


def within(measured: float, expected: float, tolerance: float = 0.10) -> bool:
    return abs(measured - expected) <= tolerance * expected


def assert_within(what: str, measured: float, expected: float) -> None:
    assert within(measured, expected), f"{what}: measured {measured:.4g}, profile {expected:.4g} (10% allowed)"


def goodput(rate_mbit: float, mtu: int = 9000) -> float:
    """What TCP carries at a link rate that counts each packet with its 14-byte Ethernet header: MSS (MTU less
    52 bytes of IP and TCP headers with timestamps) out of MTU + 14 bytes on the wire."""
    return rate_mbit * (mtu - 52) / (mtu + 14)


# ------------------------------------------------------------------------------------------------- composition


def test_two_hosts_of_one_profile_see_exactly_that_profile():
    for profile in PROFILES.values():
        path = link(profile, profile)
        assert path.delay_s == pytest.approx(profile.delay_ms / 1000)
        assert path.jitter_s == pytest.approx(profile.jitter_ms / 1000)
        assert path.loss == pytest.approx(profile.loss)
        assert path.rate_mbit == min(profile.up_mbit or 0, profile.down_mbit or 0)


def test_mixed_profiles_compose_half_from_each_end():
    home, far, lan = PROFILES["home"], PROFILES["intercontinental"], PROFILES["lan"]
    assert link(home, far).delay_s == pytest.approx(0.050)
    assert link(home, far).jitter_s == pytest.approx(0.0025)
    assert link(home, far).loss == pytest.approx(0.0005)
    assert link(home, lan).rate_mbit == 20  # home's uplink
    assert link(lan, home).rate_mbit == 100  # home's downlink
    assert not link(lan, lan).impaired and link(lan, home).impaired


def test_a_mixed_swarm_takes_the_profiles_in_turn():
    assert [p.name for p in swarm_profiles("mixed", 4)] == ["lan", "home", "intercontinental", "lan"]
    assert [p.name for p in swarm_profiles("home", 2)] == ["home", "home"]


# -------------------------------------------------------------------------------------------------- accuracy


@pytest.mark.netns
@pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)
def test_lan_is_fast_and_skips_the_delay_stage():
    with WanTestbed(seed=1) as wan:
        a, b = wan.add_host("a", "lan"), wan.add_host("b", "lan")
        assert statistics.median(probe.rtts(wan, a, b, count=20, interval=0.01)) < 0.002
        assert_within("lan a->b Mbit/s", probe.throughput(wan, a, b, seconds=1.5, warmup=0.5), goodput(1000))
        assert wan.stage_stats()["received"] == 0  # nothing to delay: lan pairs are routed past the stage


@pytest.mark.netns
@pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)
def test_home_rtt_jitter_and_asymmetric_rates_match_the_profile():
    with WanTestbed(seed=1) as wan:
        a, b = wan.add_host("a", "home"), wan.add_host("b", "home")
        office, far = wan.add_host("office", "lan"), wan.add_host("far", "intercontinental")

        samples = probe.rtts(wan, a, b, count=40, interval=0.015)
        assert len(samples) >= 38  # no loss in the profile; one late straggler at most
        assert_within("home-home RTT s", statistics.median(samples), 0.050)
        deciles = statistics.quantiles(samples, n=10)
        assert deciles[-1] - deciles[0] > 0.004, "±5 ms of jitter each way must show in the RTTs"
        # mixed profiles compose: home-intercontinental is (25 + 75) / 2 ms one way
        assert_within("home-intercontinental RTT s", statistics.median(probe.rtts(wan, a, far, count=20)), 0.100)

        assert_within("home a->b Mbit/s", probe.throughput(wan, a, b, seconds=2, warmup=0.7), goodput(20))
        assert_within("home uplink Mbit/s", probe.throughput(wan, a, office, seconds=2, warmup=0.7), goodput(20))
        assert_within("home downlink Mbit/s", probe.throughput(wan, office, a, seconds=2, warmup=0.7), goodput(100))

        stats = wan.stage_stats()
        assert stats["write_errors"] == 0 and stats["lost"] == 0
        assert stats["late_p99_s"] <= 0.005, f"the stage itself is late: {stats}"


@pytest.mark.netns
@pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)
def test_intercontinental_rtt_rate_both_ways_and_loss_match_the_profile():
    with WanTestbed(seed=1) as wan:
        a, b = wan.add_host("a", "intercontinental"), wan.add_host("b", "intercontinental")

        assert_within("intercontinental RTT s", statistics.median(probe.rtts(wan, a, b, count=30)), 0.150)
        for sender, receiver in ((a, b), (b, a)):
            mbit = probe.throughput(wan, sender, receiver, seconds=3.5, warmup=1.5)
            assert_within(f"intercontinental {sender.name}->{receiver.name} Mbit/s", mbit, goodput(100))

        lost_before = wan.stage_stats()["lost"]
        sent = 20000
        fraction = probe.loss(wan, a, b, count=sent, rate=20000)
        # 0.1% of 20000 is 20 datagrams, a binomial count (sd 4.5): "roughly" is 8 to 36 ...
        assert 8 / sent <= fraction <= 36 / sent, f"loss {fraction:.4%}, profile 0.1%"
        # ... and exactly the stage's loss draws: nothing else on the path dropped a datagram
        assert round(fraction * sent) == wan.stage_stats()["lost"] - lost_before


# --------------------------------------------------------------------------------------------------- cleanup


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


def gone(pid: int) -> bool:
    """No such process, or only a zombie no one has reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.netns
@pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)
def test_everything_is_removed_on_exit_even_after_an_exception():
    before = namespaces()

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with WanTestbed() as wan:
            host = wan.add_host("a", "home")
            wan.add_host("b", "intercontinental")
            stage = wan.stage_pid
            assert stage is not None and not gone(stage)
            ours = namespaces() - before
            assert len(ours) == 3 and all(wan.tag in name for name in ours)
            sleeper = wan.spawn(host, ["sleep", "300"])
            # a process the spawned one starts (not a child of the test): found through the namespace
            shell = wan.spawn(host, ["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
            assert shell.stdout is not None
            grandchild = int(shell.stdout.readline())
            raise Boom
    assert namespaces() == before
    assert gone(stage), "the delay stage outlived the testbed"
    assert sleeper.returncode is not None and gone(grandchild)
    assert wan.final_stage_stats is not None  # it was stopped, not merely abandoned


@pytest.mark.netns
@pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)
def test_a_stage_that_dies_takes_the_impaired_paths_down_rather_than_leaving_them_unimpaired():
    with WanTestbed() as wan:
        a, b = wan.add_host("a", "home"), wan.add_host("b", "home")
        assert wan.stage_pid is not None
        os.kill(wan.stage_pid, 9)
        wan.stage.wait()  # type: ignore[union-attr]
        assert probe.rtts(wan, a, b, count=5, interval=0.05) == []


@pytest.mark.netns
@pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)
def test_a_cut_host_is_unreachable_until_restored():
    with WanTestbed() as wan:
        a, b = wan.add_host("a", "lan"), wan.add_host("b", "home")
        wan.cut(b)
        assert probe.rtts(wan, a, b, count=5, interval=0.05) == []
        wan.restore(b)
        assert_within("RTT after restore s", statistics.median(probe.rtts(wan, a, b, count=10)), 0.025)
