"""`peer dashboard`: the web side. A Starlette app (/, /static/..., /api/v1/state, /api/v1/is_reachable/<peer>,
/api/v1/state.schema.json; anything else 404) over the `Watcher`'s view, served by Hypercorn in the same trio loop
as the watcher (peer/dashboard/http.py).

Why every request reads the view and never the swarm: a page left open (or ten of them) costs the swarm nothing
more; the swarm is asked once per refresh by the watcher, whatever the number of viewers.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

import sniffio
import trio

from peer.dashboard.http import serve_asgi
from peer.dashboard.watcher import Watcher
from peer.p2p.identity import load_membership

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
SCHEMA = HERE / "state.schema.json"


def build_app(watcher: Watcher) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def state(request: Request) -> Response:
        snapshot = watcher.snapshot()
        # which event loop answered: the test checks the page is served from trio, not asyncio
        snapshot["dashboard"] = {"async_library": sniffio.current_async_library(), "refresh_s": watcher.refresh,
                                 "attachments": watcher.attachments}
        return JSONResponse(snapshot, headers={"Cache-Control": "no-store"})

    async def is_reachable(request: Request) -> Response:
        answer = watcher.view.is_reachable(request.path_params["peer_id"])
        if answer is None:
            return JSONResponse({"error": "no such peer in the directory"}, status_code=404)
        return JSONResponse(answer, headers={"Cache-Control": "no-store"})

    async def schema(request: Request) -> Response:
        return FileResponse(SCHEMA, media_type="application/schema+json")

    return Starlette(routes=[
        Route("/", index),
        Route("/api/v1/state", state),
        Route("/api/v1/state.schema.json", schema),
        Route("/api/v1/is_reachable/{peer_id}", is_reachable),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ])


def load_schema() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(SCHEMA.read_text())
    return result


async def run_dashboard(args: argparse.Namespace) -> None:
    """Watch the swarm and serve the page until SIGINT (Ctrl-C) or SIGTERM, then return."""
    watcher = Watcher(args.initial_peers, refresh=args.refresh, timeout=args.timeout,
                      swarm_key=load_membership(args.swarm_key, None)[0])
    async with trio.open_nursery() as nursery:

        async def stop_on_signal(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                task_status.started()
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

        await nursery.start(stop_on_signal)
        await nursery.start(watcher.run)
        host, port = await nursery.start(serve_asgi, build_app(watcher), args.host, args.port, "dashboard")
        shown = f"[{host}]" if ":" in host else host
        print(f"dashboard at http://{shown}:{port}/ watching {', '.join(watcher.view.initial_peers)}", flush=True)
        print("state as JSON at /api/v1/state; Ctrl-C stops", file=sys.stderr, flush=True)
