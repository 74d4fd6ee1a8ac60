"""The dashboard in a real browser (headless Debian chromium driven by Selenium through chromium-driver): a local
swarm of 3 `peer join` daemons and 1 `peer train` trainer as processes on 127.0.0.1, and `peer dashboard`.

The page shows the 3 peers and all their experts; the run's loss plot gains points; a SIGKILLed daemon shows as
unreachable within 15 s and its experts leave the grid. Screenshots go to $DASHBOARD_ARTIFACTS (default
runs/test-artifacts/); `.ci/run` installs chromium and chromium-driver when missing, otherwise this skips."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from peer.testing.peer_processes import ROOT, PeerProcess, start_daemon

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(os.environ.get("DASHBOARD_ARTIFACTS", ROOT / "runs" / "test-artifacts"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                       reason="needs Debian's chromium and chromium-driver (.ci/run installs them as root)"),
]


def wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"{what} not within {timeout} s (last: {last!r})")


@pytest.fixture
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1500"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_dashboard_in_chromium(browser):
    processes = []
    try:
        first, _, bootstrap = start_daemon("--experts", "ffn.[0:2]", "--hidden-dim", "16", "--threads", "1")
        processes.append(first)
        daemons = {bootstrap: ["ffn.0", "ffn.1"]}
        for pattern, uids in (("ffn.[2:4]", ["ffn.2", "ffn.3"]), ("ffn.[4:6]", ["ffn.4", "ffn.5"])):
            process, _, address = start_daemon("--initial-peers", bootstrap, "--experts", pattern, "--hidden-dim",
                                               "16", "--threads", "1")
            processes.append(process)
            daemons[address] = uids
        dashboard = PeerProcess(["dashboard", "--initial-peers", bootstrap, "--port", "0", "--refresh", "1",
                                 "--timeout", "2"])
        processes.append(dashboard)
        url = dashboard.read_until(r"^dashboard at (http://\S+/)", timeout=60).group(1)
        trainer = PeerProcess(["train", "--initial-peers", bootstrap, "--steps", "100000", "--log-every", "5",
                               "--batch-size", "16", "--k-best", "2", "--hidden-dim", "16", "--grid-size", "6",
                               "--expert-prefix", "ffn"])
        processes.append(trainer)
        browser.get(url)

        # read the DOM in one script each: the page redraws every refresh, so element handles go stale
        def peers() -> dict[str, str]:
            return browser.execute_script(
                "const rows = {}; for (const row of document.querySelectorAll('#peers tbody tr'))"
                " rows[row.children[1].textContent] = row.dataset.state; return rows;")

        def served() -> set[str]:
            return set(browser.execute_script(
                "return [...document.querySelectorAll('.cell[data-uid]')].map(cell => cell.dataset.uid);"))

        all_uids = {uid for uids in daemons.values() for uid in uids}
        wait(lambda: peers() == {address: "online" for address in daemons}, 60, "3 online peers on the page")
        wait(lambda: served() == all_uids, 30, "every expert in the grid")

        def loss_points() -> int:
            return browser.execute_script("return document.querySelectorAll('svg.plot-loss circle').length;")

        wait(lambda: loss_points() >= 2, 120, "the loss plot's first points")
        before = loss_points()
        wait(lambda: loss_points() > before, 60, "the loss plot gaining points")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))

        victim_address = list(daemons)[2]
        victim = processes[2]
        victim.kill()  # SIGKILL
        killed_at = time.monotonic()
        wait(lambda: peers().get(victim_address) == "unreachable", 15, "the killed daemon shown unreachable")
        assert time.monotonic() - killed_at <= 15
        wait(lambda: served() == all_uids - set(daemons[victim_address]), 15, "its experts gone from the grid")
        assert "stopped answering" in browser.execute_script("return document.getElementById('events').textContent;")
        browser.save_screenshot(str(ARTIFACTS / "dashboard-after-kill.png"))
    finally:
        for process in reversed(processes):
            process.kill()
