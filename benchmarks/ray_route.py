"""`servelab route` in front of two replicas, local processes against Ray actors on a
two-node Ray cluster on this machine, driven by outside load generators.

    python benchmarks/ray_route.py --vllm /work/venvs/vllm/bin/vllm [--aiperf /work/venvs/aiperf/bin/aiperf]
        [--repeats 3] [--prompts 64] [--concurrency 8] [--out results.json]
        [--phases completion routers overhead]

The model is a small random Qwen3 (4 layers, hidden 256, float32) with a byte-level BPE
tokenizer trained here on the Python standard library's source (cached in
~/.cache/servelab/bench_models/), so the load generators tokenize as the server does.
Each replica gets one CPU: `--spawn` replicas are `servelab serve` processes (torch
threads 1), Ray replicas actors with `num_cpus=1` on a `ray.cluster_utils.Cluster` of two
one-CPU nodes, so each sits on its own node.

1. **Completion** (must be 100%): `vllm bench serve` with `--backend openai` and
   `--backend openai-chat` (streamed) and, with `--aiperf`, aiperf's chat profile, against
   the Ray proxy.
2. **Routers**: `vllm bench serve`'s prefix_repetition dataset (8 prefixes of 192 tokens,
   suffixes of 32, 16 output tokens) through `round_robin` and `prefix_affinity`, on each
   backend: the replicas' prefix-cache hit rate (their `vllm:prefix_cache_hits` over
   `vllm:prefix_cache_queries`, read through the proxy's `/replicas/I/metrics`, the run's
   difference).
3. **Overhead**: the random dataset (prompts of 128 tokens, 64 output tokens,
   `--max-concurrency`) through `round_robin`, local and Ray alternating by repeat (ABBA):
   output tok/s and mean TTFT as `vllm bench serve` measures them, each a mean over repeats
   with its 95% t interval, and Ray's over local's paired by repeat.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tempfile
import time

import httpx

from servelab.cluster.ray_replicas import local_cluster
from servelab.lab.provenance import cpu_model
from servelab.lab.stats import interval_text, mean_estimate, ratio_estimate

SERVELAB = os.path.join(os.path.dirname(sys.executable), "servelab")
MODELS = pathlib.Path.home() / ".cache" / "servelab" / "bench_models"
SHAPE = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "max_position_embeddings": 4096}  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SERVE = ["engine.dtype=float32", "engine.max_model_len=1024", "engine.num_threads=1",
         "allocator=paged", "allocator.prefix_caching=true", "serve.log_level=warning"]  # fmt: skip


def model_folder() -> pathlib.Path:
    """The random model and its tokenizer (built once, keyed by the shape)."""
    key = hashlib.sha256(json.dumps(SHAPE, sort_keys=True).encode()).hexdigest()[:12]
    folder = MODELS / f"ray-route-{key}"
    if (folder / "tokenizer.json").exists():
        return folder
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    source = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="ignore") for p in sorted(source.glob("*.py"))[:200]]
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=SHAPE["vocab_size"] - 8, min_frequency=2,
                                  special_tokens=["<|endoftext|>"], show_progress=False)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, eos_token_id=0, tie_word_embeddings=True))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))  # fmt: skip
    return folder


class Route:
    """`servelab route` as a subprocess; `with Route(...) as url:`."""

    def __init__(self, backend: str, router: str, folder: pathlib.Path, port: int,
                 ray_address: str | None = None) -> None:  # fmt: skip
        self.port = port
        where = (["--ray", "2", "--ray-address", ray_address, "--replica-cpus", "1"]
                 if backend == "ray" else ["--spawn", "2", "--first-replica-port", str(port + 1)])  # fmt: skip
        options = ["--router-option", "block_size=16"] if router == "prefix_affinity" else []
        self.command = [SERVELAB, "route", *where, "--router", router, *options, "--port",
                        str(port), "--", f"model.path={folder}", *SERVE]  # fmt: skip

    def __enter__(self) -> str:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        cwd=tempfile.mkdtemp(prefix="ray-route-"))  # fmt: skip
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise SystemExit(f"servelab route did not start:\n{self.log.read()[-3000:]}")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(60)


def hit_tokens(url: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, queried tokens) over both replicas."""
    hits = queries = 0.0
    for i in (0, 1):
        text = httpx.get(f"{url}/replicas/{i}/metrics", timeout=10).text
        hits += _sum(text, "vllm:prefix_cache_hits_total")
        queries += _sum(text, "vllm:prefix_cache_queries_total")
    return hits, queries


def _sum(text: str, name: str) -> float:
    return sum(
        float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def vllm_bench(vllm: str, url: str, folder: pathlib.Path, backend: str, dataset: list[str],
               prompts: int, concurrency: int) -> dict:  # fmt: skip
    out = tempfile.mkdtemp(prefix="vllm-bench-")
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    command = [vllm, "bench", "serve", "--backend", backend, "--base-url", url,
               "--endpoint", endpoint, "--model", folder.name, "--tokenizer", str(folder),
               "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
               "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", out,
               "--result-filename", "result.json", "--disable-tqdm", *dataset]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(pathlib.Path(out, "result.json").read_text())


def aiperf_bench(
    aiperf: str, url: str, folder: pathlib.Path, prompts: int, concurrency: int
) -> dict:
    out = tempfile.mkdtemp(prefix="aiperf-")
    command = [aiperf, "profile", "--model", folder.name, "--url", url, "--endpoint-type", "chat",
               "--streaming", "--tokenizer", str(folder), "--request-count", str(prompts),
               "--concurrency", str(concurrency), "--synthetic-input-tokens-mean", "128",
               "--output-tokens-mean", "32", "--extra-inputs", "ignore_eos:true",
               "--artifact-dir", out, "--ui-type", "none"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"aiperf failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    found = list(pathlib.Path(out).rglob("profile_export_aiperf.json"))
    return json.loads(found[0].read_text()) if found else {"stdout": done.stdout[-2000:]}


def aiperf_counts(result: dict) -> tuple[float, float]:
    """(requests completed, errors) from aiperf's export."""
    count = result.get("request_count", {})
    errors = result.get("error_request_count", {})
    return float(count.get("avg", 0) if isinstance(count, dict) else count), float(
        errors.get("avg", 0) if isinstance(errors, dict) else errors or 0
    )


RANDOM = ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64"]
PREFIXES = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "192",
            "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "8",
            "--prefix-repetition-output-len", "16"]  # fmt: skip


def completion(args, folder, address, ports, report: dict) -> None:
    """vllm bench serve (both backends) and aiperf through the Ray proxy: all must complete."""
    with Route("ray", "round_robin", folder, next(ports), address) as url:
        for backend in ("openai", "openai-chat"):
            r = vllm_bench(args.vllm, url, folder, backend, RANDOM, args.prompts, args.concurrency)
            report[f"complete_{backend}"] = {"completed": r["completed"], "failed": r.get("failed", 0),
                                             "num_prompts": r["num_prompts"]}  # fmt: skip
            print(f"ray, vllm bench serve --backend {backend}: {r['completed']}/{r['num_prompts']} completed",
                  flush=True)  # fmt: skip
        if args.aiperf:
            done, errors = aiperf_counts(
                aiperf_bench(args.aiperf, url, folder, args.prompts, args.concurrency)
            )
            report["complete_aiperf"] = {
                "completed": done,
                "errors": errors,
                "num_prompts": args.prompts,
            }
            print(
                f"ray, aiperf chat streaming: {done:.0f}/{args.prompts} completed, {errors:.0f} errors",
                flush=True,
            )


def routers(args, folder, address, ports, report: dict) -> None:
    """The replicas' prefix hit rate under round_robin and prefix_affinity, each backend."""
    for backend in ("local", "ray"):
        for router in ("round_robin", "prefix_affinity"):
            with Route(backend, router, folder, next(ports), address) as url:
                before = hit_tokens(url)
                r = vllm_bench(
                    args.vllm, url, folder, "openai", PREFIXES, args.prompts, args.concurrency
                )
                after = hit_tokens(url)
            rate = (after[0] - before[0]) / max(1.0, after[1] - before[1])
            report[f"hit_rate_{backend}_{router}"] = rate
            print(f"{backend:5} {router:15} prefix hit rate {rate:.3f} "
                  f"({r['completed']}/{r['num_prompts']} completed)", flush=True)  # fmt: skip


def overhead(args, folder, address, ports, report: dict) -> None:
    """Local against Ray replicas, ABBA: output tok/s, TTFT and TPOT."""
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    for repeat in range(args.repeats):
        order = ("local", "ray") if repeat % 2 == 0 else ("ray", "local")
        for backend in order:
            with Route(backend, "round_robin", folder, next(ports), address) as url:
                vllm_bench(args.vllm, url, folder, "openai", RANDOM, 8, args.concurrency)  # warm-up
                r = vllm_bench(
                    args.vllm, url, folder, "openai", RANDOM, args.prompts, args.concurrency
                )
            runs[backend].append(r)
            print(f"repeat {repeat} {backend:5}: {r['output_throughput']:.1f} out tok/s, "
                  f"TTFT {r['mean_ttft_ms']:.1f} ms", flush=True)  # fmt: skip
    for metric in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"):
        local = [r[metric] for r in runs["local"]]
        ray_ = [r[metric] for r in runs["ray"]]
        report[metric] = {"local": local, "ray": ray_}
        print(f"{metric}: local {_text(mean_estimate(local))}, ray {_text(mean_estimate(ray_))}, "
              f"ray/local {_text(ratio_estimate(ray_, local, paired=True))}", flush=True)  # fmt: skip


PHASES = {"completion": completion, "routers": routers, "overhead": overhead}


def _text(estimate) -> str:
    return f"{estimate.mean:.3g} {interval_text(estimate)} (n={estimate.n})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", required=True, help="the `vllm` command of a venv holding vLLM")
    parser.add_argument("--aiperf", help="the `aiperf` command of a venv holding aiperf")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--port", type=int, default=8600)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--phases", nargs="+", default=["completion", "routers", "overhead"],
                        choices=["completion", "routers", "overhead"])  # fmt: skip
    args = parser.parse_args()
    folder = model_folder()
    print(f"CPU: {cpu_model()}; model {folder}", flush=True)
    report: dict = {"cpu": cpu_model(), "args": vars(args) | {"out": str(args.out)}}
    with local_cluster(nodes=2, cpus_per_node=1) as cluster:
        address = cluster.address
        ports = iter(range(args.port, args.port + 1000, 10))
        for phase in args.phases:
            PHASES[phase](args, folder, address, ports, report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
