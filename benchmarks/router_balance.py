"""Is concentrating on one replica right? `prefix_affinity` against `least_load` on multi-turn
chats, simulated (Llama-3-8B on `h100-sxm`, prefix caching), over several workload seeds.
A benchmark, not a test: it composes each config as `servelab` does (Hydra, the same
overrides), runs `run_cluster` once per router and seed (a virtual clock: one run is exact
for its seed; the seeds vary the prompts and the arrivals) and prints, per case and router,
the mean over the seeds of the mean and p99 time to first token, the prefix hit rate and the
load imbalance, each with its 95% t interval, then each router's difference from
`least_load`, paired by seed. `prefix_affinity:0` is the rule with `min_saved_tokens=0`:
affinity whenever the cache covers `cache_threshold` of the prompt, below the balance limits.

    python benchmarks/router_balance.py                          # every case, 10 seeds
    python benchmarks/router_balance.py --cases low --seeds 5
    python benchmarks/router_balance.py -- router.cache_threshold=0.3   # more overrides

Cases: `low` is the multi_turn workload's defaults (8 chats of 4 turns, 12-token messages and
replies, one 40-token system prompt, 4 conversations a second) over 4 replicas; `low_long` the
same with 200-token messages, 120-token replies and 6 turns; `busier` 32 chats at 16 a
second; `preset` is experiment=routers_multi_turn (96 chats of 6 turns over 8 replicas).
"""

from __future__ import annotations

import argparse

BASE = [
    "cluster=colocated",
    "executor=simulated",
    "hardware=h100-sxm",
    "model=llama3-8b",
    "engine.dtype=bfloat16",
    "engine.gpu_memory_utilization=0.9",
    "engine.max_model_len=8192",
    "engine.max_num_seqs=256",
    "allocator.prefix_caching=true",
    "workload=multi_turn",
]
CASES = {
    "low": ["cluster.replicas=4"],
    "low_long": ["cluster.replicas=4", "workload.message_len=200", "workload.output_len=120",
                 "workload.turns=6"],  # fmt: skip
    "busier": ["cluster.replicas=4", "workload.num_conversations=32", "workload.rate=16"],
    "preset": ["experiment=routers_multi_turn"],
}
ROUTERS = {
    "least_load": ["router=least_load"],
    "prefix_affinity": ["router=prefix_affinity"],
    "prefix_affinity:0": ["router=prefix_affinity", "router.min_saved_tokens=0"],
}
FIGURES = ("ttft_mean_ms", "ttft_p99_ms", "prefix_hit_rate", "load_imbalance")


def compose(args: list[str]) -> dict:
    """The config `servelab ARGS` would run, as a plain dict."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_module("servelab.conf", version_base="1.3"):
        return OmegaConf.to_container(hydra_compose("config", overrides=args), resolve=True)


def figures(case: str, router: str, seed: int, extra: list[str]) -> dict[str, float]:
    from servelab.lab.cluster.run import run_cluster

    config = compose([*BASE, *CASES[case], *ROUTERS[router], f"workload.seed={seed}", *extra])
    summary = run_cluster(config).summary
    return {name: float(summary[name]) for name in FIGURES}


def interval(values: list[float]) -> str:
    from servelab.lab.stats import mean_estimate

    estimate = mean_estimate(values)
    return f"{estimate.mean:8.3f} ± {estimate.half_width:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("extra", nargs="*", help="more Hydra overrides")
    args = parser.parse_args()
    for case in args.cases.split(","):
        runs = {r: [figures(case, r, s, args.extra) for s in range(args.seeds)] for r in ROUTERS}
        print(f"\n{case} ({args.seeds} seeds; mean ± 95% half-width)")
        print(f"{'router':18s}" + "".join(f"{name:>22s}" for name in FIGURES))
        for router, rows in runs.items():
            print(f"{router:18s}" + "".join(f"{interval([r[n] for r in rows]):>22s}"
                                            for n in FIGURES))  # fmt: skip
        for router, rows in runs.items():
            if router == "least_load":
                continue
            base = runs["least_load"]
            diffs = [interval([r[n] - b[n] for r, b in zip(rows, base)]) for n in FIGURES[:2]]
            print(f"  {router} - least_load, paired: TTFT mean {diffs[0]} ms, p99 {diffs[1]} ms")


if __name__ == "__main__":
    main()
