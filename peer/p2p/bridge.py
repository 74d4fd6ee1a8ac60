"""A background trio thread that ordinary synchronous code (a PyTorch training loop) calls into.

Why: the network side of a peer is a trio program, while autograd and user training loops are plain threads.
The bridge runs one trio event loop in a daemon thread; synchronous code hands it coroutines with `run` and
blocks for the result, and long-lived services (an RPC node, a DHT node) live in the bridge's nursery until
`close()` cancels them, so shutdown leaves no task or socket behind.
"""

from __future__ import annotations

import threading
from typing import Any, Awaitable, Callable, TypeVar

import trio

T = TypeVar("T")


class BridgeClosed(RuntimeError):
    """The bridge's trio thread is not running (closed, or it crashed)."""


class Bridge:
    def __init__(self) -> None:
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="swarmd-bridge", daemon=True)
        self._failure: BaseException | None = None
        self._closed = False

    @classmethod
    def start(cls) -> "Bridge":
        bridge = cls()
        bridge._thread.start()
        bridge._ready.wait()
        if bridge._failure is not None:
            raise BridgeClosed(f"the bridge thread failed to start: {bridge._failure}")
        return bridge

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as error:  # reported to callers through BridgeClosed
            self._failure = error
        finally:
            self._closed = True
            self._ready.set()

    async def _serve(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await trio.sleep_forever()

    @property
    def in_bridge_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `async_fn(*args)` in the bridge's trio thread and return its result (or raise its exception)."""
        if self._closed or self._token is None:
            raise BridgeClosed("the bridge is closed")
        if self.in_bridge_thread:
            raise RuntimeError("Bridge.run called from the bridge's own thread; await the function instead")
        try:
            return trio.from_thread.run(async_fn, *args, trio_token=self._token)
        except trio.RunFinishedError as error:
            raise BridgeClosed("the bridge closed while the call was running") from error

    def run_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Schedule the plain function `fn(*args)` in the bridge's trio thread and return at once, without its
        result: for hints (wake a background task) a training thread sends on its hot path, where `run`'s round
        trip to the trio thread and back (~50 us of CPU, far more on shared cores) is the cost being avoided.
        Calls from one thread run in the order they were made, and before a later `run` of that thread."""
        if self._closed or self._token is None:
            raise BridgeClosed("the bridge is closed")
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError as error:
            raise BridgeClosed("the bridge closed") from error

    def start_service(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start a long-lived task in the bridge's nursery; it is cancelled when the bridge closes."""

        async def spawn() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(async_fn, *args)

        self.run(spawn)

    def start_and_wait(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Start a service with `nursery.start` semantics and return the value it passes to `task_status.started`."""

        async def spawn() -> Any:
            assert self._nursery is not None
            return await self._nursery.start(async_fn, *args)

        return self.run(spawn)

    def close(self) -> None:
        if self._closed:
            self._thread.join()
            return

        def cancel() -> None:
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()

        try:
            trio.from_thread.run_sync(cancel, trio_token=self._token)
        except trio.RunFinishedError:
            pass
        self._thread.join()
        self._closed = True

    def __enter__(self) -> "Bridge":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
