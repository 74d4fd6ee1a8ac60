"""`SwarmOptimizer`: what a training loop uses of an optimizer that trains with the swarm.

Both `CollaborativeOptimizer` (average every collective epoch) and `DiLoCoOptimizer` (local inner steps, then an
outer step on averaged pseudo-gradients) implement it, so a loop written against it (`peer train`'s runner, a
user's own loop) never asks which algorithm it holds. The algorithms differ in what "done" means (a count of
local steps, or of the swarm's outer steps) and in what they report; those differences live behind
`more_steps`, `shortfall` and `report`, not in the caller."""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, runtime_checkable

import torch
import trio

from averaging.state import install_state_server
from peer.p2p.addresses import local_host_towards

if TYPE_CHECKING:
    from typing_extensions import Self

    from averaging.progress import ProgressTracker
    from dht.client import SwarmHandle
    from peer.p2p.net import Address

logger = logging.getLogger(__name__)


@runtime_checkable
class SwarmOptimizer(Protocol):
    """The surface both swarm optimizers share (a `torch.optim.Optimizer`-like face plus the run's end)."""

    optimizer: torch.optim.Optimizer  # the wrapped one: it takes the local steps

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (for learning-rate schedulers)."""
        ...

    @property
    def lock(self) -> threading.Lock:
        """Held while averaging writes parameters; hold it to touch them from another thread."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step(self, batch_size: int | None = None) -> bool:
        """Account one local batch after `loss.backward()`; True when this call changed the model with the swarm
        (an averaged epoch or outer step applied, or state downloaded)."""
        ...

    def more_steps(self, step: int, planned: int) -> bool:
        """Whether a loop planned for `planned` local steps takes another after `step` of them."""
        ...

    def shortfall(self, step: int, planned: int) -> str | None:
        """After the loop: one line saying what the run fell short of (None when it did its job)."""
        ...

    def finish(self, timeout: float | None = None) -> bool:
        """End training with the swarm, before `close()`; True when this trainer holds the swarm's final state."""
        ...

    def report(self, final: bool = False) -> dict[str, Any]:
        """The figures of a progress line (`final=False`) or of the run's result (`final=True`)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Everything this trainer counted (a superset of `report`)."""
        ...

    def close(self) -> None:
        """Stop publishing progress and leave averaging; the swarm itself stays open."""
        ...


class SwarmOptimizerBase(abc.ABC):
    """What both optimizers do alike: the torch face over the wrapped optimizer, starting their trio-side services
    where partners can reach them, serving their state to trainers that catch up, and leaving the run.
    Subclasses set `optimizer`, `swarm`, `tracker`, `_lock` and `_scope` (the cancel scope of their trio-side
    services), and define `_serve` (those services) and `_get_state` (what a newcomer downloads)."""

    optimizer: torch.optim.Optimizer
    swarm: SwarmHandle
    tracker: ProgressTracker
    _lock: threading.Lock
    _scope: trio.CancelScope | None

    @abc.abstractmethod
    async def _serve(self, listen_host: str | None, *,
                     task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
        """The optimizer's trio-side services, run by `_start_serving` until its cancel scope is cancelled."""

    @abc.abstractmethod
    def _get_state(self) -> tuple[Any, list[torch.Tensor]]:
        """What a trainer that catches up downloads: (metadata, tensors)."""

    def _start_serving(self, listen: bool, listen_host: str | None) -> trio.CancelScope:
        """Start `_serve` in the swarm's trio thread and return its cancel scope. A listening optimizer without
        `listen_host` listens on the interface toward the swarm's first initial peer, the one its partners share
        (loopback for a handle that names none, e.g. a test's); one that does not listen gets None."""
        host = listen_host
        if listen and host is None:
            initial_peers = getattr(self.swarm, "initial_peers", None)  # a Swarm has them; a test's handle may not
            host = local_host_towards(initial_peers[0]) if initial_peers else "127.0.0.1"
        scope: trio.CancelScope = self.swarm.bridge.start_and_wait(self._serve, host if listen else None)
        return scope

    @contextlib.asynccontextmanager
    async def _serving_state(self, listen_host: str | None) -> AsyncIterator[Address | None]:
        """For `_serve`: listen on `listen_host` unless the RPC node listens already; then, while the body runs and
        this trainer has an address to be reached at, serve `_get_state` (under the lock) to those catching up and
        announce the address in the progress records. Yields that address (None: this trainer serves nothing)."""
        rpc = self.swarm.rpc
        if listen_host is not None and rpc.announced_address is None:
            await rpc.listen(listen_host, 0)
        address = rpc.announced_address
        if address is None:
            yield None
            return
        state_server = install_state_server(rpc, self._get_state, lock=self._lock)
        self.tracker.address = address
        try:
            yield address
        finally:
            state_server.uninstall()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def lock(self) -> threading.Lock:
        """Held while averaging writes parameters (averaged updates, outer steps, downloads, snapshots served to
        others); hold it to touch them from another thread."""
        return self._lock

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Stop publishing progress and leave averaging (the swarm itself stays open); a goodbye record makes the
        others stop counting this trainer at once."""
        scope, self._scope = self._scope, None
        if scope is None or getattr(self.swarm, "bridge", None) is None:
            return

        async def cancel() -> None:
            scope.cancel()
            await self.tracker.leave()

        try:
            self.swarm.bridge.run(cancel)
        except Exception as error:  # the bridge already closed: nothing left to stop
            logger.debug("%s: close after the bridge: %s", type(self).__name__, error)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


__all__ = ["SwarmOptimizer", "SwarmOptimizerBase"]
