"""Giving freed heap memory back to the operating system after a burst of large calls.

Why this exists (issue 40): 1,000 concurrent `moe.forward` calls of 512 KiB each left the server's RSS 250 MB
above its level before, long after every call had ended. Nothing leaked: the tensors and buffers were freed, but
glibc keeps freed heap pages in its arenas. Its mmap threshold rises to the size of the largest chunk freed
(up to 32 MiB), so after the first burst, buffers of a call's size come from the heap, and freed holes in the
middle of a heap are never returned on their own. `malloc_trim(0)` returns every whole free page, from the
middle of each arena too (madvise), in a few milliseconds.

`TrimPolicy` decides when (sans-I/O: the RSS and the time in, a yes or no out): when the RSS has grown by
`grown` bytes over what it was after the last trim, at most once per `interval`. A process that holds steady
never trims; one that just served a flood trims within `interval` of it, and again only once it grows again.
`keep_returning_memory` is the trio loop that feeds it. Where the C library has no `malloc_trim` (musl, macOS),
`trim` does nothing and says so once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Any

import trio

from peer.p2p.periodic import run_periodic

logger = logging.getLogger(__name__)

MB = 1 << 20


def rss_bytes() -> int:
    """This process's resident set size in bytes (0 where /proc is not available)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL("libc.so.6")
        function = libc.malloc_trim
    except (OSError, AttributeError):
        logger.info("this C library has no malloc_trim: freed heap memory stays with the process")
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


def trim() -> bool:
    """Return the heap's free pages to the OS; False where the C library cannot."""
    function = _malloc_trim()
    if function is None:
        return False
    function(0)
    return True


class TrimPolicy:
    """When to trim: the RSS has grown by `grown` bytes over its level after the last trim (or the first
    reading), and `interval` seconds have passed since the last trim."""

    def __init__(self, *, grown: int = 64 * MB, interval: float = 5.0):
        self.grown = grown
        self.interval = interval
        self.floor: int | None = None
        self.last: float | None = None
        self.trims = 0

    def due(self, rss: int, now: float) -> bool:
        if self.floor is None or rss < self.floor:
            self.floor = rss  # the level to come back to: the lowest seen since the last trim
            return False
        if self.last is not None and now - self.last < self.interval:
            return False
        return rss - self.floor >= self.grown

    def trimmed(self, rss: int, now: float) -> None:
        """After a trim: what the RSS came back to is the new floor."""
        self.floor, self.last = rss, now
        self.trims += 1


async def keep_returning_memory(policy: TrimPolicy | None = None, *,
                                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Check the RSS every `policy.interval` seconds and trim when the policy says so; until cancelled."""
    policy = policy or TrimPolicy()

    async def check() -> None:
        if policy.due(rss_bytes(), trio.current_time()) and trim():
            policy.trimmed(rss_bytes(), trio.current_time())

    await run_periodic(check, policy.interval, name="returning freed memory", log=logger, traceback=True,
                       task_status=task_status)
