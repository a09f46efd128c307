"""Replicas as Ray actors: each actor holds one `servelab serve` engine and app, and the
proxy (servelab.cluster.proxy) talks to it through an httpx transport, so routing,
relaying and retrying are the same code for Ray replicas as for HTTP ones.

A request crosses as (method, path, headers, body) to the actor's `request` method, a Ray
streaming generator: the actor runs its app in-process (plain ASGI, no socket) and yields
the response start `(status, headers)`, then every body chunk as the app sends it, so a
streamed completion reaches the proxy event by event. Cancelling the generator (the
client left) tells the app its client disconnected, which aborts the engine request.

Placement: each replica is one actor with `num_cpus` / `num_gpus` (a tensor-parallel
replica reserves its `tensor_parallel_size` shares in one placement group, packed on one
node); Ray restarts an actor that dies up to `max_restarts` times (the engine is built
again, its cache cold). Ray is imported here only: nothing else in the package needs it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from servelab.errors import ConfigError


class ReplicaServer:
    """The actor's body: a `servelab serve` Server (engine, loop thread, app), no uvicorn."""

    def __init__(self, config: Mapping, choices: Mapping | None = None) -> None:
        from servelab.serve.server import Server

        self.server = Server(config, choices)
        self.server.aengine.start()
        self.app = self.server.app

    async def request(
        self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> AsyncIterator[Any]:
        """Yields `(status, headers)`, then the body's chunks (bytes), as the app sends them."""
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        path_only, _, query = path.partition("?")
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path_only,
            "raw_path": path_only.encode(), "query_string": query.encode(), "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            "client": ("ray-proxy", 0), "server": ("ray-replica", 0),
        }  # fmt: skip
        app = asyncio.ensure_future(self.app(scope, receive, sent.put))
        try:
            while True:
                getter = asyncio.ensure_future(sent.get())
                await asyncio.wait({getter, app}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the app returned (or failed) with nothing more queued
                    getter.cancel()
                    app.result()  # re-raises the app's failure
                    return
                message = getter.result()
                if message["type"] == "http.response.start":
                    yield (message["status"],
                           [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])])  # fmt: skip
                elif message["type"] == "http.response.body":
                    # what the app sent meanwhile goes in the same item: one Ray object per
                    # chunk would cost a streamed token more than the token itself
                    body, more = bytearray(message.get("body", b"")), message.get("more_body")
                    while more and not sent.empty():
                        nxt = sent.get_nowait()
                        body += nxt.get("body", b"")
                        more = nxt.get("more_body")
                    if body:
                        yield bytes(body)
                    if not more:
                        return
        finally:  # done, or cancelled by the proxy: the app learns its client left
            gone.set()
            if not app.done():
                try:
                    await asyncio.wait_for(app, timeout=5)
                except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                    app.cancel()

    async def health(self) -> str | None:
        """Why this replica cannot serve (None: it can)."""
        return self.server.aengine.problem()

    def where(self) -> tuple[int, str]:
        """(process id, Ray node id) of this replica."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def free_blocks(self) -> tuple[int, int]:
        """(KV blocks free, KV blocks in all): a replica at rest holds none."""
        usage = self.server.engine.allocator.usage()
        total = usage.get("blocks_total", 0)
        return usage.get("blocks_free", total), total


class RayTransport(httpx.AsyncBaseTransport):
    """An httpx transport whose requests go to a Ray actor's `request` generator. A dead or
    unreachable actor is an `httpx.ConnectError` before the response starts and an
    `httpx.ReadError` after, as a dropped HTTP replica would be."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor, self.name = actor, name

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import ray.exceptions

        body = await request.aread()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() != "host"]
        path = request.url.raw_path.decode("ascii")
        stream = self.actor.request.remote(request.method, path, headers, body)
        try:
            status, response_headers = await (await stream.__anext__())
        except (ray.exceptions.RayError, StopAsyncIteration) as err:
            _cancel(stream)
            raise httpx.ConnectError(
                f"replica {self.name}: {_reason(err)}", request=request
            ) from err
        return httpx.Response(status, headers=response_headers, request=request,
                              stream=_RayBody(stream, self.name, request))  # fmt: skip


class _RayBody(httpx.AsyncByteStream):
    def __init__(self, stream: Any, name: str, request: httpx.Request) -> None:
        self.stream, self.name, self.request = stream, name, request
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        import ray.exceptions

        try:
            async for ref in self.stream:
                yield await ref
        except ray.exceptions.RayError as err:
            raise httpx.ReadError(
                f"replica {self.name}: {_reason(err)}", request=self.request
            ) from err
        self.finished = True

    async def aclose(self) -> None:
        if not self.finished:  # the client left, or the proxy gave up on this replica
            _cancel(self.stream)


def _cancel(stream: Any) -> None:
    import ray

    try:
        ray.cancel(stream)
    except Exception:  # noqa: BLE001 (already finished, or its actor is gone)
        pass


def _reason(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


@dataclass
class RayPlacement:
    """Where each replica goes: its CPU and GPU shares (per tensor-parallel rank) and how
    often Ray restarts it."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_restarts: int = 0
    tensor_parallel_size: int = 1


def connect(address: str | None) -> None:
    """Joins the Ray cluster at `address` (`auto`: the one this machine belongs to; a
    `ray://` or GCS address) or, with `local` or None, starts one here."""
    import ray

    if ray.is_initialized():
        return
    if address in (None, "", "local"):
        ray.init(include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


@contextmanager
def local_cluster(nodes: int = 2, cpus_per_node: int = 1) -> Iterator[Any]:
    """A Ray cluster of `nodes` nodes on this machine (`ray.cluster_utils.Cluster`: a head
    and workers, each its own raylet), joined by this process; shut down on exit."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node,
                      "include_dashboard": False})  # fmt: skip
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class RayReplicas:
    """N replica actors of the same serve config; `transports()` for the proxy."""

    def __init__(self, count: int, config: Mapping, choices: Mapping | None = None,
                 placement: RayPlacement | None = None) -> None:  # fmt: skip
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if count < 1:
            raise ConfigError(f"a Ray cluster needs at least one replica, got {count}")
        self.placement = placement = placement or RayPlacement()
        actor_class = ray.remote(ReplicaServer)
        self.groups: list = []
        self.actors: list = []
        for _ in range(count):
            # a task on a dead actor is not retried by Ray: the proxy resubmits requests
            options: dict[str, Any] = {"max_restarts": placement.max_restarts,
                                       "max_task_retries": 0}  # fmt: skip
            tp = placement.tensor_parallel_size
            if tp > 1:  # the ranks' shares together, on one node
                bundle = {"CPU": placement.num_cpus * tp}
                if placement.num_gpus:
                    bundle["GPU"] = placement.num_gpus * tp
                group = placement_group([bundle], strategy="STRICT_PACK")
                self.groups.append(group)
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group)
                options.update(num_cpus=placement.num_cpus * tp, num_gpus=placement.num_gpus * tp)
            else:
                options.update(num_cpus=placement.num_cpus, num_gpus=placement.num_gpus)
            self.actors.append(actor_class.options(**options).remote(dict(config), choices))
        self.names = [f"ray-{i}" for i in range(count)]

    def wait_ready(self, timeout: float) -> None:
        """Until every replica answers healthy; a replica that failed to build raises its
        error, one that cannot be placed within `timeout` a ConfigError naming it."""
        import ray

        refs = [actor.health.remote() for actor in self.actors]
        ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if waiting:
            late = [self.names[refs.index(r)] for r in waiting]
            raise ConfigError(
                f"Ray replicas {', '.join(late)} not ready after {timeout:.0f} s "
                f"(is there room for num_cpus={self.placement.num_cpus}, "
                f"num_gpus={self.placement.num_gpus} each? `ray status` shows the cluster)"
            )
        for name, problem in zip(self.names, ray.get(refs)):
            if problem is not None:
                raise ConfigError(f"Ray replica {name} cannot serve: {problem}")

    def transports(self) -> list[RayTransport]:
        return [RayTransport(actor, name) for actor, name in zip(self.actors, self.names)]

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 (already gone)
                pass
        for group in self.groups:
            remove_placement_group(group)
