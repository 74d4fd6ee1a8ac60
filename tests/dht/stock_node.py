"""Stock `kademlia.network.Server` nodes in a child process, driven by JSON lines (tests and benchmarks only).

WHY a subprocess: the stock package is asyncio, and swarmd never runs asyncio in its own processes. Interop tests
and the DHT benchmark need real stock nodes next to ours, so this file is two things:

* run as a script (`python stock_node.py --nodes N`), it starts N stock servers on 127.0.0.1 (never 0.0.0.0),
  prints one `{"event": "ready", "ports": [...], "ids": [...]}` line, then answers one JSON line per command read
  from stdin (`bootstrap`, `set`, `get`, `local`, `neighbors`, `received`, `stop_node`, `exit`). Each reply
  echoes the command's `id`. The process exits when stdin closes, so it never outlives its driver.
* imported (by trio code), `StockNodes.open(...)` starts that process and talks to it with bounded waits; the
  process is killed when the context exits, whatever happened.

asyncio is imported only inside the script's entry point, so importing this module keeps a process asyncio-free.

JSON cannot carry bytes, so keys and values that are bytes travel as `{"bytes": "<base64>"}`.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import signal
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

SCRIPT = Path(__file__).resolve()


# ------------------------------------------------------------------------------------------------ JSON value codec


def to_json(value: Any) -> Any:
    """Make a stock DHT value (or key) JSON-safe: bytes become {"bytes": base64}, containers recurse."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {"dict": [[to_json(k), to_json(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"repr": repr(value)}


def from_json(value: Any) -> Any:
    """Inverse of `to_json`."""
    if isinstance(value, list):
        return [from_json(item) for item in value]
    if isinstance(value, dict):
        if "bytes" in value:
            return base64.b64decode(value["bytes"])
        if "dict" in value:
            return {from_json(k): from_json(v) for k, v in value["dict"]}
        if "repr" in value:
            return ("repr", value["repr"])
        raise ValueError(f"unknown JSON value tag: {sorted(value)}")
    return value


# ------------------------------------------------------------------------------------------------ child process


def _serve_main(argv: list[str]) -> None:
    """Entry point of the child process: asyncio and the stock package live only here."""
    import asyncio
    import logging

    from kademlia.network import Server
    from kademlia.node import Node
    from kademlia.protocol import KademliaProtocol
    from kademlia.utils import digest

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--ksize", type=int, default=20)
    parser.add_argument("--alpha", type=int, default=3)
    parser.add_argument("--seed", default=None, help="derive node ids from this seed (reproducible placement)")
    parser.add_argument("--log-level", default="CRITICAL")
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr)

    class CountingProtocol(KademliaProtocol):
        """The stock protocol, unchanged, plus a count of every request received per (method, sender).

        Tests use the count to prove that our node never sends an extension RPC twice to a stock node.
        """

        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.received: dict[str, dict[str, int]] = {}

        async def _accept_request(self, msg_id: bytes, data: Any, address: tuple) -> None:
            if isinstance(data, list) and len(data) == 2 and isinstance(data[0], str):
                sender = f"{address[0]}:{address[1]}"
                per_sender = self.received.setdefault(data[0], {})
                per_sender[sender] = per_sender.get(sender, 0) + 1
            await super()._accept_request(msg_id, data, address)

    class CountingServer(Server):
        protocol_class = CountingProtocol

    def key_of(raw: Any) -> Any:
        key = from_json(raw)
        if not isinstance(key, (str, bytes, int)):
            raise ValueError(f"keys are str, bytes or int, not {type(key).__name__}")
        return key

    def contacts(nodes: Any) -> list[list[Any]]:
        return [[node.id.hex(), node.ip, node.port] for node in nodes]

    def write(message: dict) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    async def handle(servers: list[Any], command: dict) -> dict:
        op = command.get("op")
        if op == "exit":
            return {}
        index = command.get("node", 0)
        if not isinstance(index, int) or not 0 <= index < len(servers) or servers[index] is None:
            raise ValueError(f"no running stock node {index!r}")
        server = servers[index]
        started = time.perf_counter()
        if op == "bootstrap":
            peers = [(host, int(port)) for host, port in command["peers"]]
            found = await server.bootstrap(peers)
            return {"found": contacts(found), "ms": (time.perf_counter() - started) * 1000}
        if op == "set":
            result = await server.set(key_of(command["key"]), from_json(command["value"]))
            return {"result": bool(result), "ms": (time.perf_counter() - started) * 1000}
        if op == "get":
            value = await server.get(key_of(command["key"]))
            return {"value": to_json(value), "ms": (time.perf_counter() - started) * 1000}
        if op == "local":  # what this node itself holds, without a network lookup
            return {"value": to_json(server.storage.get(digest(key_of(command["key"]))))}
        if op == "neighbors":
            return {"nodes": contacts(server.protocol.router.find_neighbors(server.node, k=10_000))}
        if op == "received":
            return {"received": server.protocol.received}
        if op == "find_node":  # one raw RPC to one address: is that peer alive and speaking the stock protocol?
            host, port = command["address"]
            target = Node(bytes.fromhex(command["target"]))
            ok, result = await server.protocol.find_node((host, int(port)), server.node.id, target.id)
            return {"answered": bool(ok), "result": to_json(result)}
        if op == "stop_node":
            server.stop()
            servers[index] = None
            return {}
        raise ValueError(f"unknown op {op!r}")

    async def run_command(servers: list[Any], command: dict) -> None:
        reply: dict[str, Any] = {"id": command.get("id")}
        try:
            reply.update(await handle(servers, command))
            reply["ok"] = True
        except Exception as error:  # a failed command is reported to the driver; the nodes keep running
            reply.update(ok=False, error=f"{type(error).__name__}: {error}")
        write(reply)

    async def main() -> None:
        servers: list[Any] = []
        for index in range(args.nodes):
            node_id = digest(f"stock-node:{args.seed}:{index}") if args.seed is not None else None
            server = CountingServer(ksize=args.ksize, alpha=args.alpha, node_id=node_id)
            await server.listen(0, interface="127.0.0.1")
            servers.append(server)
        ports = [server.transport.get_extra_info("sockname")[1] for server in servers]
        write({"event": "ready", "pid": os.getpid(), "ports": ports, "ids": [s.node.id.hex() for s in servers]})

        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break  # the driver went away: so do we
                command = json.loads(line)
                if command.get("op") == "exit":
                    write({"id": command.get("id"), "ok": True})
                    break
                task = asyncio.ensure_future(run_command(servers, command))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
            for server in servers:
                if server is not None:
                    server.stop()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------ trio driver


class StockNodeError(Exception):
    """A command sent to the stock process failed, timed out, or the process died."""


class StockNodes:
    """A child process running `count` stock kademlia servers on 127.0.0.1; every method has a bounded wait.

    Use `async with StockNodes.open(count) as stock:`; the process is killed (SIGKILL) when the block exits if it
    has not exited by itself within a second of being asked to.
    """

    def __init__(self, process: Any, ready: dict):
        import trio

        self.process = process
        self.pid: int = ready["pid"]
        self.ports: list[int] = ready["ports"]
        self.ids: list[bytes] = [bytes.fromhex(i) for i in ready["ids"]]
        self.running: list[bool] = [True] * len(self.ports)
        self._ids = itertools.count()
        self._waiting: dict[int, Any] = {}
        self._replies: dict[int, dict] = {}
        self._send_lock = trio.Lock()
        self._dead = False

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", port) for port in self.ports]

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        count: int = 1,
        *,
        seed: int | str | None = None,
        ksize: int = 20,
        alpha: int = 3,
        startup_timeout: float = 30.0,
        stderr: int | None = None,
    ) -> AsyncIterator["StockNodes"]:
        import subprocess

        import trio

        command = [sys.executable, str(SCRIPT), "--nodes", str(count), "--ksize", str(ksize), "--alpha", str(alpha)]
        if seed is not None:
            command += ["--seed", str(seed)]
        process = await trio.lowlevel.open_process(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
        )
        try:
            lines = _LineReader(process.stdout)
            with trio.fail_after(startup_timeout):
                ready = json.loads(await lines.readline())
            if ready.get("event") != "ready":
                raise StockNodeError(f"stock process did not start: {ready}")
            stock = cls(process, ready)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stock._read_replies, lines)
                try:
                    yield stock
                finally:
                    with trio.CancelScope(shield=True):
                        await stock._shutdown()
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                with trio.move_on_after(5):
                    await process.wait()
                for stream in (process.stdin, process.stdout):
                    if stream is not None:
                        await trio.aclose_forcefully(stream)

    async def _read_replies(self, lines: "_LineReader") -> None:
        try:
            while True:
                line = await lines.readline()
                if not line:
                    break
                reply = json.loads(line)
                event = self._waiting.pop(reply.get("id"), None)
                if event is not None:
                    self._replies[reply["id"]] = reply
                    event.set()
        finally:
            self._dead = True
            for event in self._waiting.values():
                event.set()

    async def _shutdown(self) -> None:
        import trio

        if self.process.returncode is None and not self._dead:
            with trio.move_on_after(1.0):
                try:
                    await self.request("exit", timeout=1.0)
                except StockNodeError:
                    pass
                await self.process.wait()

    async def request(self, op: str, *, timeout: float = 30.0, **fields: Any) -> dict:
        """Send one command and wait (at most `timeout` seconds) for its reply; raise StockNodeError on failure."""
        import trio

        if self._dead or self.process.returncode is not None:
            raise StockNodeError(f"stock process {self.pid} is not running ({op})")
        request_id = next(self._ids)
        event = trio.Event()
        self._waiting[request_id] = event
        line = (json.dumps({"id": request_id, "op": op, **fields}) + "\n").encode()
        try:
            with trio.fail_after(timeout):
                async with self._send_lock:
                    await self.process.stdin.send_all(line)
                await event.wait()
        except trio.TooSlowError:
            raise StockNodeError(f"stock {op} got no reply within {timeout} s") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise StockNodeError(f"stock process {self.pid} is gone ({op}): {error}") from None
        finally:
            self._waiting.pop(request_id, None)
        reply = self._replies.pop(request_id, None)
        if reply is None:
            raise StockNodeError(f"stock process {self.pid} exited before answering {op}")
        if not reply.get("ok"):
            raise StockNodeError(f"stock {op} failed: {reply.get('error')}")
        return reply

    # ---------------------------------------------------------------------------------------- typed commands

    async def bootstrap(self, node: int, peers: list[tuple[str, int]], *, timeout: float = 30.0) -> list[tuple]:
        """Stock `Server.bootstrap(peers)`; returns the contacts it found as (id, host, port)."""
        reply = await self.request("bootstrap", node=node, peers=[list(p) for p in peers], timeout=timeout)
        return [(bytes.fromhex(i), host, port) for i, host, port in reply["found"]]

    async def set(self, node: int, key: Any, value: Any, *, timeout: float = 60.0) -> tuple[bool, float]:
        """Stock `Server.set(key, value)`; returns (its result, milliseconds measured inside the stock process)."""
        reply = await self.request("set", node=node, key=to_json(key), value=to_json(value), timeout=timeout)
        return reply["result"], reply["ms"]

    async def get(self, node: int, key: Any, *, timeout: float = 60.0) -> tuple[Any, float]:
        """Stock `Server.get(key)`; returns (value or None, milliseconds measured inside the stock process)."""
        reply = await self.request("get", node=node, key=to_json(key), timeout=timeout)
        return from_json(reply["value"]), reply["ms"]

    async def local(self, node: int, key: Any, *, timeout: float = 10.0) -> Any:
        """The value node `node` itself stores under `key` (no lookup), or None."""
        return from_json((await self.request("local", node=node, key=to_json(key), timeout=timeout))["value"])

    async def neighbors(self, node: int, *, timeout: float = 10.0) -> list[tuple[bytes, str, int]]:
        """Every contact in node `node`'s routing table."""
        reply = await self.request("neighbors", node=node, timeout=timeout)
        return [(bytes.fromhex(i), host, port) for i, host, port in reply["nodes"]]

    async def received(self, node: int, *, timeout: float = 10.0) -> dict[str, dict[str, int]]:
        """Requests node `node` received so far: {method: {"host:port" of sender: count}}."""
        return (await self.request("received", node=node, timeout=timeout))["received"]

    async def stop_node(self, node: int, *, timeout: float = 10.0) -> None:
        """Close one node's socket: from outside it is gone, exactly as if its process died."""
        await self.request("stop_node", node=node, timeout=timeout)
        self.running[node] = False

    def kill(self) -> None:
        """SIGKILL the whole process: every node in it stops answering at once, without warning."""
        if self.process.returncode is None:
            self.process.kill()
        self.running = [False] * len(self.running)

    def freeze(self) -> None:
        """SIGSTOP: the nodes hang (packets to them are silently queued, never answered)."""
        if self.process.returncode is None:
            os.kill(self.process.pid, signal.SIGSTOP)
        self.running = [False] * len(self.running)

    def thaw(self) -> None:
        if self.process.returncode is None:
            os.kill(self.process.pid, signal.SIGCONT)


class _LineReader:
    """Newline-delimited reads from a trio ReceiveStream (trio has none built in)."""

    def __init__(self, stream: Any):
        self._stream = stream
        self._buffer = bytearray()

    async def readline(self) -> bytes:
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[: end + 1])
                del self._buffer[: end + 1]
                return line
            chunk = await self._stream.receive_some(1 << 16)
            if not chunk:
                line = bytes(self._buffer)
                self._buffer.clear()
                return line
            self._buffer += chunk


if __name__ == "__main__":
    _serve_main(sys.argv[1:])
