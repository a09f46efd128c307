"""Console scripts: `servelab` (the Hydra app; `servelab serve` the server, `servelab route`
the cluster proxy), `servelab-report`,
`servelab-plugins`."""

from __future__ import annotations

import sys
from pathlib import Path

from servelab.errors import ServelabError


def _hydra_app(cfg) -> dict | None:
    """One run: build, serve the workload, write results.json / requests.csv /
    steps.csv into the Hydra output folder, print the summary table. A run that
    fails writes results.json with `status: error`; in a sweep (`-m`) the next
    job still runs (and the sweep exits 1 when it ends), alone it exits 2."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("hydra", None)
    hydra_cfg = HydraConfig.get()
    choices = {k: v for k, v in hydra_cfg.runtime.choices.items() if not k.startswith("hydra")}
    meta = {
        "overrides": list(hydra_cfg.overrides.task),
        "choices": choices,
        "job": {"name": hydra_cfg.job.name, "num": hydra_cfg.job.get("num")},
    }
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    folder = Path(hydra_cfg.runtime.output_dir)
    repeats = (config.get("run") or {}).get("repeats", 1)
    if in_sweep or not isinstance(repeats, int) or repeats <= 1:
        return _one_run(config, meta, folder, in_sweep)
    # one configuration run `repeats` times (a sweep interleaves them across configurations)
    summary = None
    for repeat in range(repeats):
        config["run"]["repeat"] = repeat
        again = {**meta, "overrides": [*meta["overrides"], f"run.repeat={repeat}"]}
        summary = _one_run(config, again, folder / f"repeat-{repeat}", in_sweep)
    print(f"servelab: {repeats} runs in {folder}; compare them with: servelab-report {folder}")
    return summary


def _one_run(config: dict, meta: dict, folder: Path, in_sweep: bool) -> dict | None:
    from servelab.contracts.kinds import KINDS
    from servelab.lab.runner import model_name, print_summary, run_config, save_failed_run, save_run

    meta = {**meta, "choices": {**meta["choices"], "model": model_name(config)}}
    if config.get("cluster"):  # engines behind a router (servelab.lab.cluster)
        from servelab.lab.cluster.cli_run import run_cluster_job
        from servelab.lab.cluster.pd_cli import is_real_pair, run_pair_job

        if is_real_pair(config):  # prefill and decode in two real processes
            return run_pair_job(config, meta, folder)

        return run_cluster_job(config, meta, folder, in_sweep)
    from servelab.lab.sweep import job_line

    num = meta["job"].get("num")
    # in a sweep the job's one line replaces the serving progress and the table
    quiet = {**config, "run": {**(config.get("run") or {}), "progress": False}}
    try:
        result = run_config(quiet if in_sweep else config)
    except Exception as err:
        if not (in_sweep or isinstance(err, ServelabError)):
            raise  # a servelab bug outside a sweep: the traceback is what helps
        message = str(err) if isinstance(err, ServelabError) else f"{type(err).__name__}: {err}"
        save_failed_run(folder, config, meta, message)
        if in_sweep:
            print(job_line(num, meta["overrides"], folder, error=message), file=sys.stderr)
            return None  # the sweep goes on; servelab-report lists the failed job
        print(f"servelab: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    # what the engine made of the device options (graphs captured, or why not)
    meta["cuda_graphs"] = result.engine.executor.graphs_status
    save_run(folder, result, config, meta)
    simulated = result.provenance.get("simulated")
    if in_sweep:
        line = job_line(num, meta["overrides"], folder, result.summary, simulated=simulated)
        print(line, flush=True)
        return result.summary
    title = ", ".join(f"{k}={_part_name(config[k])}" for k in KINDS if k in config)
    print_summary(result.summary, title=title, simulated=simulated)
    print(f"servelab: run folder: {folder}")  # on its own line, so it can be copied
    return result.summary


class ReportAtSweepEnd:
    """A Hydra callback (conf/config.yaml, `hydra.callbacks`): when a sweep
    (`-m`) starts, says how many jobs it runs (each then prints one line,
    servelab.lab.sweep); when it ends, prints its folder, writes its report
    there and prints the claims' verdicts, unless `report.after_sweep=false`.
    A report that fails says why; the runs stay. Last, a line names the jobs
    that failed, if any did, and `servelab` then exits 1. It runs in the
    process that launched the sweep, whichever launcher ran the jobs: it reads
    their results.json in the sweep's folder."""

    def on_multirun_start(self, config, **kwargs) -> None:
        from servelab.lab.sweep import start

        print(start(config), flush=True)

    def on_multirun_end(self, config, **kwargs) -> None:
        from servelab.lab.sweep import finish

        folder = Path(str(config.hydra.sweep.dir))
        print(f"servelab: sweep folder: {folder}")
        self._report(config, folder)
        failed = finish(folder)
        if failed:  # last, where it is seen
            sys.stdout.flush()
            print(failed, file=sys.stderr, flush=True)

    @staticmethod
    def _report(config, folder: Path) -> None:
        from servelab.lab.progress import is_terminal
        from servelab.lab.report import report as write
        from servelab.lab.sweep import verdict_lines

        report = config.get("report") or {}
        if not report.get("after_sweep", True):
            print(f"servelab: report it with: servelab-report {folder}")
            return
        try:  # a live bar on a terminal; in a log, the sweep's lines are enough
            written = write([folder], progress=is_terminal(sys.stderr))
        except ServelabError as err:
            print(f"servelab: the report failed: {err}", file=sys.stderr)
            return
        if written.claims:
            print("servelab: claims:", *verdict_lines(written.claims, written.settings), sep="\n")
        print(f"servelab: report: {written.out / 'summary.md'}")

    # the rest of Hydra's callback interface: nothing to do
    def on_run_start(self, config, **kwargs) -> None:
        pass

    def on_run_end(self, config, **kwargs) -> None:
        pass

    def on_job_start(self, config, **kwargs) -> None:
        pass

    def on_job_end(self, config, job_return, **kwargs) -> None:
        pass


def _part_name(node) -> str:
    return node.get("name", "?") if isinstance(node, dict) else str(node)


def main() -> None:
    import os
    import warnings

    import hydra
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from servelab.lab.config_schema import composition_message
    from servelab.registry.plugin_manager import get_plugin_manager

    # plugins may add config-group options (`scheduler=sjf`) before Hydra composes
    get_plugin_manager().register_configs(ConfigStore.instance())
    if sys.argv[1:2] == ["route"]:  # `servelab route ...`: the proxy (servelab.cluster.route_cli)
        from servelab.cluster.route_cli import main as route

        try:
            raise SystemExit(route(sys.argv[2:]))
        except ServelabError as err:
            print(f"servelab route: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
    task = _hydra_app
    if len(sys.argv) > 1 and sys.argv[1] == "serve":  # `servelab serve key=value ...`
        del sys.argv[1]
        task = _serve_app
    elif sys.argv[1:3] == ["bench", "serve"]:  # `servelab bench serve key=value ...`
        del sys.argv[1:3]
        task = _bench_app
    hint = flag_hint(sys.argv[1:])
    if hint:
        print(f"servelab: error: {hint}", file=sys.stderr)
        raise SystemExit(2)
    app = hydra.main(version_base="1.3", config_path="pkg://servelab.conf", config_name="config")(
        task
    )
    # Hydra would print a composition error as a multi-line report and exit 1;
    # letting it through (HYDRA_FULL_ERROR) turns it into one `servelab: error:` line
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    # conf/hydra/launcher/ray.yaml stands in for the Ray launcher's own `ray` config on
    # purpose; Hydra merges that one under it and warns that such a merge is deprecated
    warnings.filterwarnings("ignore", SCHEMA_MATCHED, UserWarning)
    try:
        app()
    except (HydraException, OmegaConfBaseException) as err:
        message = open_node_message(err, sys.argv[1:]) or composition_message(err)
        print(f"servelab: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    from servelab.lab.sweep import SWEEP

    if SWEEP.get("failed"):  # a sweep with failed jobs (ReportAtSweepEnd named them)
        raise SystemExit(1)


# the warning Hydra gives when a config of servelab's has the name of a plugin's schema
SCHEMA_MATCHED = r"\s*'hydra/launcher/\w+' is validated against ConfigStore schema"


# Hydra's own flags (`servelab --help` lists them); every other `--flag` is an option
# written as another tool's: servelab's options are key=value
HYDRA_FLAGS = frozenset({"help", "hydra-help", "version", "cfg", "resolve", "package", "info",
                         "run", "multirun", "shell-completion", "config-path", "config-name",
                         "config-dir", "experimental-rerun"})  # fmt: skip


def flag_hint(argv: list[str]) -> str | None:
    """For the first `--name value` (or `--name=value`) that is not Hydra's own flag, the
    key=value to write instead (`--max-num-seqs 8`: engine.max_num_seqs=8); None if none."""
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or arg == "--":
            continue
        name, sep, value = arg[2:].partition("=")
        if name in HYDRA_FLAGS:
            continue
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if not sep and following and not following.startswith("-") and "=" not in following:
            value = following
        key = name.replace("-", "_")
        if "." not in key:
            from servelab.engine.build import ENGINE_DEFAULTS

            key = f"engine.{key}" if key in ENGINE_DEFAULTS else key
        return (f"options are key=value, not --flags: write {key}={value or '...'} instead of "
                f"{' '.join([arg, value] if value and not sep else [arg])} "
                "(servelab --help lists the config groups and every option)")  # fmt: skip
    return None


def open_node_message(err: BaseException, argv: list[str]) -> str | None:
    """A misspelt option of a part or a workload (`scheduler.chunk_sise=3`):
    Hydra only knows the node has no such key. Composed again with the option
    added (`+`), the part's own check says what the Python API says, with the
    valid keys. None when the error is another one, or the check passes."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    from servelab.errors import ConfigError
    from servelab.lab.config_schema import OPEN_NODES

    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        cause = cause.__cause__ or cause.__context__
    full_key = str(getattr(cause, "full_key", "") or "")
    node = full_key.partition(".")[0]
    if node not in OPEN_NODES or node == "model" or "." not in full_key:
        return None
    overrides = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue  # -m, --multirun and the like
        key, _, value = arg.partition("=")
        if "," in value and not value.startswith(("[", "{", "'", '"')):
            value = value.split(",")[0]  # a swept choice: its first value will do
        overrides.append(f"+{key}={value}" if key == full_key else f"{key}={value}")
    try:
        GlobalHydra.instance().clear()
        with initialize_config_module("servelab.conf", version_base="1.3"):
            spec = OmegaConf.to_container(compose("config", overrides=overrides)[node], resolve=True)
        return check_open_node(node, spec)
    except ConfigError as problem:
        return str(problem)
    except Exception:  # noqa: BLE001 (the original message is still there to show)
        return None


def check_open_node(node: str, spec) -> str | None:
    """The check `LLM(...)` makes of a part's or a workload's options; raises ConfigError."""
    if node == "workload":
        from servelab.lab.workload import check_keys, workload_options

        options = dict(spec)
        name = options.pop("name", None)
        check_keys(options, list(workload_options(name)), f"workload {name!r}")
        return None
    from servelab.registry.options import check_options, describe_options, split_component
    from servelab.registry.plugin_manager import lookup

    name, options = split_component(spec, node)
    check_options(node, name, options, describe_options(lookup(node, name), node))
    return None


def report_main(argv: list[str] | None = None) -> None:
    """`servelab-report PATH... [report.KEY=VALUE...] [--out DIR]`: see servelab.lab.report."""
    from servelab.lab.report import main as report

    try:
        report(argv)
    except ServelabError as err:
        print(f"servelab-report: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _serve_app(cfg) -> None:
    """`servelab serve ...`: compose as `servelab` does, then serve (servelab.serve)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from servelab.serve.server import Server

    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("hydra", None)
    choices = HydraConfig.get().runtime.choices
    try:
        server = Server(config, {k: v for k, v in choices.items() if not k.startswith("hydra")})
    except ServelabError as err:
        print(f"servelab serve: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(server.run())


CLIENT_GROUPS = ("experiment", "workload")  # what `bench serve` chooses; the server, the rest


def _bench_app(cfg) -> None:
    """`servelab bench serve ...`: the workload replayed against the server at
    serve.host:serve.port; results.json / requests.csv in the Hydra output folder."""
    import asyncio

    import httpx
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from servelab.lab.bench_serve import bench_summary, replay
    from servelab.lab.provenance import provenance
    from servelab.lab.runner import RunResult, print_summary, save_run
    from servelab.lab.workload import make_workload
    from servelab.serve.config import serve_options

    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("hydra", None)
    options = serve_options(config.get("serve"))
    url = f"http://{options['host']}:{options['port']}"
    headers = {"authorization": f"Bearer {options['api_key']}"} if options["api_key"] else {}
    try:
        model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
        print(f"servelab bench serve: error: no server at {url} ({err})", file=sys.stderr)
        raise SystemExit(2) from None
    requests = make_workload(config["workload"], model["vocab_size"], model["max_model_len"])
    records, tokens, wall = asyncio.run(
        replay(url, requests, options["bench_concurrency"], options["api_key"])
    )
    summary = bench_summary(records, tokens, wall)
    folder = Path(HydraConfig.get().runtime.output_dir)
    ours = {k: v for k, v in HydraConfig.get().runtime.choices.items() if k in CLIENT_GROUPS}
    choices = {**ours, **(model.get("servelab_choices") or {}), "model": model["id"]}
    meta = {"overrides": list(HydraConfig.get().overrides.task), "mode": "bench_serve",
            "choices": choices, "server": url}  # fmt: skip
    record = {**provenance(config, model["id"]), "client": "servelab bench serve"}
    save_run(folder, RunResult(None, summary, records, [], record), config, meta)
    print_summary(summary, title=f"servelab bench serve against {url} ({model['id']})\n{folder}")
