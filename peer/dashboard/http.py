"""Serving an ASGI app inside our trio program: Hypercorn's trio worker, started in the caller's nursery.

Why Hypercorn's trio worker: the dashboard and the metrics endpoint must live in the same event loop as the peer
they watch (a daemon's stats are read between its own tasks, never from another thread), and our concurrency is
trio. Hypercorn parses HTTP (h11) and runs the app as a trio task; Starlette, the app framework, is anyio-based, so
it runs on trio unchanged. No HTTP is parsed here.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

logger = logging.getLogger(__name__)


class HTTPStartError(OSError):
    """The HTTP endpoint could not listen (port in use, address not local)."""


def bind_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_asgi(app: Any, host: str, port: int, name: str, *,
                     task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on host:port until cancelled; `started` with the bound (host, port) (port 0: a free one).
    `name` says what it is in errors ("dashboard", "metrics")."""
    # worker_serve with our own sockets (as Hypercorn's own runner calls it): a port in use is a plain OSError
    # here, before any nursery, and port 0 tells us the port it got
    from hypercorn.config import Config
    from hypercorn.trio.run import worker_serve
    from hypercorn.utils import wrap_app

    config = Config()
    config.bind = [bind_text(host, port)]
    config.accesslog = None
    config.errorlog = logging.getLogger(f"peer.{name}.http")
    config.graceful_timeout = 1.0  # cancelling the nursery stops the server within a second
    config.keep_alive_timeout = 30.0
    try:
        sockets = config.create_sockets()
    except OSError as error:
        raise HTTPStartError(error.errno, f"{name}: cannot listen on {bind_text(host, port)}: "
                                          f"{error.strerror or error}") from None
    bound = sockets.insecure_sockets[0].getsockname()
    for sock in sockets.insecure_sockets:  # listen now: `started` means connections are accepted
        sock.listen(config.backlog)
    wrapped = wrap_app(app, config.wsgi_max_body_size, None)

    async def run(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await worker_serve(wrapped, config, sockets=sockets, task_status=task_status)

    async with trio.open_nursery() as nursery:
        await nursery.start(run)
        task_status.started((str(bound[0]), int(bound[1])))
