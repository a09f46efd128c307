"""`servelab route`: the OpenAI-compatible proxy (servelab.cluster.proxy) in front of
replicas given by URL or spawned here as `servelab serve` processes.

    servelab route --replicas http://hostA:8000,http://hostB:8000 --router least_load
    servelab route --spawn 2 --router prefix_affinity --router-option block_size=8 \\
        -- model=qwen3-0.6b engine.max_model_len=2048      # each replica's `servelab serve` overrides
    servelab route --ray 4 --ray-address auto --replica-gpus 1 -- model=qwen3-0.6b

Spawned replicas listen on --first-replica-port, +1, ...; they are stopped when the proxy
stops. With --ray, each replica is a Ray actor holding one engine (servelab.cluster.
ray_replicas), placed by its CPU and GPU shares on the Ray cluster at --ray-address
(`local`: one started here); the actors end with the proxy. A replica that fails is marked
down and its requests resubmitted to a live one (--retries, 0: they end with an error
naming it); --health-interval paces the checks that notice a dead or restarted replica.
The proxy listens on --host:--port.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx

from servelab.cluster.dispatch import Dispatcher
from servelab.cluster.proxy import create_proxy_app
from servelab.errors import ConfigError
from servelab.registry.construct import construct
from servelab.serve.server import _uvicorn_server

SERVELAB = os.path.join(
    os.path.dirname(sys.executable), "servelab"
)  # the console script beside this Python


def parse_args(argv: list[str]) -> argparse.Namespace:
    serve_overrides: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, serve_overrides = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(prog="servelab route", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--replicas", help="comma-separated base URLs of running replicas")
    where.add_argument("--spawn", type=int, help="start this many local `servelab serve` replicas")
    where.add_argument("--ray", type=int, metavar="N", help="start N replicas as Ray actors")
    ray = parser.add_argument_group("Ray replicas (--ray)")
    ray.add_argument("--ray-address", default="local",
                     help="`local` (start Ray here), `auto` (this machine's cluster) or an address")  # fmt: skip
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica (per rank)")
    ray.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica (per rank)")
    ray.add_argument("--max-restarts", type=int, default=0,
                     help="times Ray restarts a dead replica (-1: always)")  # fmt: skip
    parser.add_argument("--retries", type=int, default=1,
                        help="resubmissions of a request whose replica failed (0: none)")  # fmt: skip
    parser.add_argument("--health-interval", type=float, default=2.0,
                        help="seconds between the replicas' health checks (0: none)")  # fmt: skip
    parser.add_argument("--router", default="round_robin", help="a registered router's name")
    parser.add_argument("--router-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a router option (JSON value), repeatable")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--first-replica-port", type=int, default=8100)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    args.serve_overrides = serve_overrides
    return args


def router_node(name: str, options: list[str]) -> dict:
    node: dict = {"name": name}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--router-option wants KEY=VALUE, got {item!r}")
        try:
            node[key] = json.loads(value)
        except ValueError:
            node[key] = value
    return node


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def spawn_replicas(count: int, first_port: int, overrides: list[str]) -> tuple[list, list[str]]:
    busy = [p for p in range(first_port, first_port + count) if port_in_use(p)]
    if busy:  # a replica that cannot bind would leave the proxy talking to someone else's server
        raise ConfigError(f"ports {busy} are in use; pick another --first-replica-port")
    processes, urls = [], []
    for i in range(count):
        port = first_port + i
        command = [SERVELAB, "serve", f"serve.port={port}",
                   f"hydra.run.dir={os.getcwd()}/route-replica-{i}", *overrides]  # fmt: skip
        processes.append(subprocess.Popen(command))
        urls.append(f"http://127.0.0.1:{port}")
    return processes, urls


def wait_healthy(urls: list[str], processes: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if any(p.poll() is not None for p in processes):
                raise ConfigError(f"a spawned replica exited before serving ({url})")
            if time.monotonic() > deadline:
                raise ConfigError(f"replica {url} not healthy after {timeout:.0f} s")
            time.sleep(0.5)


def compose_serve_config(overrides: list[str]) -> tuple[dict, dict]:
    """The config `servelab serve OVERRIDES` would serve, and its config-group choices."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("servelab.conf", version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        if "Config search path:" in lines:  # where Hydra looked: noise here
            lines = lines[: lines.index("Config search path:")]
        raise ConfigError(f"the replicas' overrides {' '.join(overrides)!r}: {'; '.join(lines)}") from None
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    config = OmegaConf.to_container(cfg, resolve=False)
    config.pop("hydra", None)
    GlobalHydra.instance().clear()
    return OmegaConf.to_container(OmegaConf.create(config), resolve=True), choices


def start_ray_replicas(args: argparse.Namespace):
    """`--ray N`: the serve config composed here, then N replica actors on Ray, healthy."""
    from servelab.cluster.ray_replicas import RayPlacement, RayReplicas, connect

    config, choices = compose_serve_config(args.serve_overrides)
    engine = config.get("engine") or {}
    placement = RayPlacement(args.replica_cpus, args.replica_gpus, args.max_restarts,
                             int(engine.get("tensor_parallel_size", 1) or 1))  # fmt: skip
    connect(args.ray_address)
    replicas = RayReplicas(args.ray, config, choices, placement)
    try:
        replicas.wait_ready(args.startup_timeout)
    except BaseException:
        replicas.stop()
        raise
    return replicas


def main(argv: list[str]) -> int:
    import uvicorn

    args = parse_args(argv)
    processes: list = []
    replicas = None
    clients = None
    try:
        if args.ray:
            replicas = start_ray_replicas(args)
            urls = replicas.names
            clients = [httpx.AsyncClient(transport=t, base_url=f"http://{name}", timeout=None)
                       for t, name in zip(replicas.transports(), urls)]  # fmt: skip
        elif args.spawn:
            processes, urls = spawn_replicas(
                args.spawn, args.first_replica_port, args.serve_overrides
            )
        else:
            urls = [u.strip().rstrip("/") for u in args.replicas.split(",") if u.strip()]
        if not urls:
            raise ConfigError("servelab route needs at least one replica")
        if replicas is None:
            wait_healthy(urls, processes, args.startup_timeout)
        router = construct(
            "router", router_node(args.router, args.router_option), num_replicas=len(urls)
        )
        app = create_proxy_app(Dispatcher(router, len(urls)), urls, clients, retries=args.retries,
                               health_interval=args.health_interval)  # fmt: skip
        print(f"servelab route: {args.router} over {', '.join(urls)} at http://{args.host}:{args.port}",
              flush=True)  # fmt: skip
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", lifespan="off"
        )
        # servelab serve's uvicorn server: it does not re-raise SIGTERM after shutting down,
        # so the `finally` below still stops the spawned replicas
        _uvicorn_server()(config).run()
        return 0
    finally:
        if replicas is not None:
            replicas.stop()
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(30)
