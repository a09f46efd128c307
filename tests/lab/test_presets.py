"""Each preset, end to end at a reduced size: its multirun through the
`servelab` command, then `servelab-report`; the test reads the produced
summary.csv and asserts the direction of the preset's counted claims (steps,
tokens, bytes, hits), so a change that flips one fails here. Timed claims
(tok/s, latencies) are the report's to decide, over repeats: a test never
asserts the wall clock (tests/lab/test_wall_clock_asserts.py)."""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

from omegaconf import OmegaConf
from PIL import Image

SERVELAB = Path(sys.executable).parent / "servelab"
SIMULATED = ("executor=simulated", "hardware=cpu-local")  # a virtual clock, no model weights


def run_preset(tmp_path: Path, preset: str, *overrides: str, env: dict | None = None
               ) -> dict[str, dict]:  # fmt: skip
    """Runs `servelab -m experiment=PRESET ...` (with `env`'s variables added), which
    reports on its folder when it ends; returns summary.csv's rows keyed by the swept
    values, "/"-joined."""
    out = tmp_path / preset
    command = (
        [str(SERVELAB)]
        if SERVELAB.exists()
        else [sys.executable, "-c", "from servelab.cli import main; main()"]
    )
    command += [
        "-m",
        f"experiment={preset}",
        f"hydra.sweep.dir={out}",
        "run.progress=false",
        "run.repeats=1",  # a claim's direction, not its interval: one run per configuration
        *overrides,
    ]
    environment = None if env is None else {**os.environ, **env}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    # the sweep ends by printing its folder and writing its report there (cli.ReportAtSweepEnd)
    assert f"servelab: sweep folder: {out}\n" in done.stdout
    assert f"servelab: report: {out / 'summary.md'}\n" in done.stdout
    with open(out / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    columns = list(rows[0])
    swept = columns[: columns.index("runs")]  # one row per configuration: its choices first
    markdown = (out / "summary.md").read_text()
    keys = ["/".join(row[k] for k in swept) for row in rows]
    for row in rows:  # summary.md lists every configuration
        assert "| " + " | ".join(row[k] for k in swept) + f" | {row['runs']} |" in markdown
    return {key: {k: number(v) for k, v in row.items()} for key, row in zip(keys, rows)}


def number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def test_continuous_vs_static(tmp_path):
    overrides = ("workload.repeat=2", "workload.scale=0.2")
    runs = run_preset(tmp_path, "continuous_vs_static", *overrides)
    backends = ("padded", "per_request", "flash_varlen")
    assert set(runs) == {f"{s}/{a}" for s in ("static", "continuous") for a in backends}

    # the timed claim (output tok/s) is the report's to decide, over repeats: a test
    # asserts what the engine counted, which a busy machine cannot change
    for attention in backends:
        continuous, static = runs[f"continuous/{attention}"], runs[f"static/{attention}"]
        assert continuous["steps"] < 0.7 * static["steps"]
        assert static["idle_slot_pct"] > 10 and continuous["idle_slot_pct"] == 0
        assert continuous["output_digest"] == static["output_digest"]  # same tokens either way
    assert runs["static/padded"]["padding_waste_pct"] > 10  # the padded backend measured it
    assert runs["static/per_request"]["padding_waste_pct"] == 0
    markdown = (tmp_path / "continuous_vs_static" / "summary.md").read_text()
    assert markdown.count("continuous batching needs less than half the steps") == len(
        backends
    )  # one per backend
    for plot in ("claims", "throughput", "latency_cdf", "kv_util", "batch", "timeline"):
        with Image.open(tmp_path / "continuous_vs_static" / f"{plot}.png") as image:
            low, high = image.convert("L").getextrema()
            assert image.width > 100 and low < high


def test_paged_vs_contiguous(tmp_path):
    runs = run_preset(
        tmp_path, "paged_vs_contiguous",
        "workload.num_requests=24", "workload.output_len.min=16", "workload.output_len.max=48",
    )  # fmt: skip
    paged, contiguous = runs["paged"], runs["contiguous"]
    assert paged["reservation_waste_pct"] < 4 < contiguous["reservation_waste_pct"]
    assert paged["peak_seqs"] >= 2 * contiguous["peak_seqs"]
    assert paged["finished_pct"] == contiguous["finished_pct"] == 100


def test_prefix_caching(tmp_path):
    """At the preset's size: its KV cache fills and evicts with caching, and the eviction
    costs no hit (least recently used first: the requests' own tails, never the shared
    prompt every new request reads), while the run without caching never preempts."""
    from servelab.lab.workload import make_workload

    runs = run_preset(tmp_path, "prefix_caching")
    cached, plain = runs["true"], runs["false"]
    assert cached["prefix_hit_tokens"] > 0 and plain["prefix_hit_tokens"] == 0
    # every prompt token is either computed or served from the cache
    assert cached["prefill_tokens"] + cached["prefix_hit_tokens"] == plain["prefill_tokens"]
    assert cached["prefill_tokens"] < 0.3 * plain["prefill_tokens"]
    assert cached["output_digest"] == plain["output_digest"]
    assert cached["evictions"] > 0 and plain["evictions"] == 0
    assert plain["preemptions"] == cached["preemptions"] == 0
    assert plain["peak_kv_util_pct"] > 50  # the cache is sized to the work, not 64 MiB idle
    # the shared 512 tokens hit for every request that has them (a prompt over 512 tokens:
    # the others are 32 to 64), except those of the first wave of 4, which run together
    conf = files("servelab.conf")
    node: dict = {}
    for part in (conf / "workload" / "synthetic.yaml", conf / "workload" / "shared_prefix.yaml"):
        node.update(OmegaConf.to_container(OmegaConf.load(part)))
    node.update(OmegaConf.to_container(
        OmegaConf.load(conf / "experiment" / "prefix_caching.yaml").workload))  # fmt: skip
    node.pop("defaults", None)
    requests = make_workload(node, vocab_size=256)
    shared = [len(r.prompt_token_ids) > 512 for r in requests]
    assert len(requests) == 64 and sum(shared) == 48
    assert cached["prefix_hit_tokens"] == 512 * (sum(shared) - sum(shared[:4]))


def test_chunked_prefill(tmp_path):
    overrides = (
        "workload.num_long=2", "workload.long_prompt_len=1536", "workload.decoder_output_len=96",
        "workload.first_long_at=0.02", "workload.long_every=0.05",
    )  # fmt: skip
    runs = run_preset(tmp_path, "chunked_prefill", *overrides)
    chunked, whole = runs["chunked"], runs["continuous"]
    assert whole["longest_stall_prefill_tokens"] == 1536
    assert chunked["longest_stall_prefill_tokens"] <= 2 * 512  # a chunk of each prompt in flight

    # its stall in milliseconds is the preset report's timed claim, decided over repeats


def test_swap_vs_recompute(tmp_path):
    runs = run_preset(
        tmp_path, "swap_vs_recompute",
        "workload.num_requests=8", "workload.output_len.min=128", "workload.output_len.max=192",
        "engine.kv_cache_memory=512KiB",
    )  # fmt: skip
    swap, recompute = runs["swap"], runs["recompute"]
    assert swap["finished_pct"] == recompute["finished_pct"] == 100
    assert swap["preemptions_swap"] > 0 and swap["swapped_out_bytes"] > 0
    assert recompute["preemptions_recompute"] > 0 and recompute["recomputed_tokens"] > 0
    assert recompute["swapped_out_bytes"] == 0
    assert swap["output_digest"] == recompute["output_digest"]  # a preempted request loses nothing


def test_attention_backends(tmp_path):
    runs = run_preset(
        tmp_path, "attention_backends",
        "workload.num_requests=4", "workload.output_len.min=4", "workload.output_len.max=8",
    )  # fmt: skip
    assert set(runs) == {"padded", "per_request", "flash_varlen"}  # triton_paged: not on a CPU
    assert len({run["output_digest"] for run in runs.values()}) == 1
    assert all(run["step_ms_mean"] > 0 for run in runs.values())
    assert runs["padded"]["padding_waste_pct"] > 0 == runs["per_request"]["padding_waste_pct"]
    markdown = (tmp_path / "attention_backends" / "summary.md").read_text()
    assert "✅ holds: every backend produced the same output tokens" in markdown


def test_fairness(tmp_path):
    runs = run_preset(tmp_path, "fairness")
    fcfs, vtc = runs["continuous"], runs["vtc"]
    assert fcfs["arrival_share_pct_light"] == vtc["arrival_share_pct_light"] < 28
    # FCFS serves the backlog in arrival order: the light client's share is its arrivals'
    assert fcfs["service_share_pct_light"] < 28 and vtc["service_share_pct_light"] > 32
    assert vtc["client_gap_to_bound"] < 1 < fcfs["client_gap_to_bound"]
    assert vtc["output_digest"] == fcfs["output_digest"]  # the order changes, not the tokens


def preset_claims(preset: str) -> list[dict]:
    """The claims a preset's report decides, as its YAML states them."""
    node = OmegaConf.load(files("servelab.conf") / "experiment" / f"{preset}.yaml")
    return OmegaConf.to_container(node.report.claims)


def hashed_hits_without_eviction(chats=8, turns=6, system=40, message=12, reply=12, block=16):
    """Prompt tokens hashed 16-token blocks serve on radix_vs_hashed's chats when
    nothing is evicted. Turn k resends turn k-1's prompt and reply, whose KV is
    computed except the reply's last token (it never runs through the model); the
    cache serves the whole blocks of that. A first turn finds the system prompt's
    whole blocks, except the two that open the run together and compute it both."""
    hits = (chats - 2) * (system // block * block)
    for k in range(1, turns):
        computed = system + (k - 1) * (message + reply) + message + reply - 1
        hits += chats * (computed // block * block)
    return hits


def test_radix_vs_hashed(tmp_path):
    runs = run_preset(tmp_path, "radix_vs_hashed")
    hit = {key: run["prefix_hit_rate"] for key, run in runs.items()}
    more_hits, less_prefill, lpm_gain = preset_claims("radix_vs_hashed")
    # the preset's claims, each by its own bound: radix over hashed blocks in FCFS order,
    # and longest-prefix-first over FCFS for both allocators
    assert hit["radix/fcfs"] >= more_hits["ratio_at_least"] * hit["paged/fcfs"] > 0
    radix, hashed = runs["radix/fcfs"], runs["paged/fcfs"]
    assert radix["prefill_tokens"] <= less_prefill["ratio_at_most"] * hashed["prefill_tokens"]
    assert lpm_gain["ratio_at_least"] > 1
    for allocator in ("paged", "radix"):
        assert hit[f"{allocator}/lpm"] >= lpm_gain["ratio_at_least"] * hit[f"{allocator}/fcfs"]
    markdown = (tmp_path / "radix_vs_hashed" / "summary.md").read_text()
    assert markdown.count("✅ holds") == 4 and "fails" not in markdown  # LPM: once per allocator
    # every prompt token is computed or served from cache; the tokens are the same
    for run in runs.values():
        assert run["preemptions"] == 0
        assert run["prefill_tokens"] + run["prefix_hit_tokens"] == run["prompt_tokens"]
    assert len({run["output_digest"] for run in runs.values()}) == 1
    # decided by counting, not by this machine's speed: under executor=simulated (a virtual
    # clock, step times from a cost model) every run makes the same decisions
    simulated = run_preset(tmp_path / "simulated", "radix_vs_hashed", *SIMULATED)
    counted = ("prefix_hit_tokens", "prefill_tokens", "prompt_tokens", "steps")
    for key, run in runs.items():
        assert [simulated[key][c] for c in counted] == [run[c] for c in counted], key
    # the LPM gain is the memory pressure's: with ample KV memory nothing is evicted, the
    # two orders hit the same, and hashed blocks hit what the block arithmetic says
    ample = run_preset(
        tmp_path / "ample", "radix_vs_hashed", *SIMULATED, "engine.kv_cache_memory=4MiB"
    )
    for allocator in ("paged", "radix"):
        lpm, fcfs = ample[f"{allocator}/lpm"], ample[f"{allocator}/fcfs"]
        assert (
            lpm["prefix_hit_tokens"]
            == fcfs["prefix_hit_tokens"]
            > runs[f"{allocator}/fcfs"]["prefix_hit_tokens"]
        )
    assert ample["paged/fcfs"]["prefix_hit_tokens"] == hashed_hits_without_eviction()
    # the radix tree matches at any token (blocks of one), and caches the history of each
    # of two chats that prefill together, not only the first one's
    assert ample["radix/fcfs"]["prefix_hit_tokens"] == hashed_hits_without_eviction(block=1)


def test_hybrid_preemption(tmp_path):
    overrides = ("workload.num_requests=12", "engine.kv_cache_memory=512KiB")
    runs = run_preset(tmp_path, "hybrid_preemption", *overrides)
    assert set(runs) == {"recompute", "swap", "hybrid"}
    swap, recompute, hybrid = runs["swap"], runs["recompute"], runs["hybrid"]
    assert all(run["finished_pct"] == 100 for run in runs.values())
    # hybrid swaps the long victims and recomputes the short ones
    assert hybrid["preemptions_swap"] >= 1 and hybrid["preemptions_recompute"] >= 1
    assert 0 < hybrid["recomputed_tokens"] < recompute["recomputed_tokens"]
    assert 0 < hybrid["swapped_out_bytes"] < swap["swapped_out_bytes"]
    assert recompute["swapped_out_bytes"] == 0 == swap["recomputed_tokens"]
    assert len({run["output_digest"] for run in runs.values()}) == 1  # nothing lost either way


def test_mlfq_vs_fcfs(tmp_path):
    runs = run_preset(tmp_path, "mlfq_vs_fcfs")
    fcfs, mlfq = runs["continuous"], runs["mlfq"]
    assert mlfq["preemptions"] >= 1 and fcfs["preemptions"] == 0
    assert mlfq["swapped_out_bytes"] > 0
    assert mlfq["finished_pct"] == fcfs["finished_pct"] == 100
    assert mlfq["output_digest"] == fcfs["output_digest"]  # the order changes, not the tokens
    # all requests at once: the step each request finishes at is counted, not timed;
    # MLFQ finishes the short requests first, so mean and median finish steps fall
    finish_steps = {}
    for folder in (tmp_path / "mlfq_vs_fcfs").iterdir():
        if (folder / "requests.csv").exists():
            scheduler = json.loads((folder / "results.json").read_text())["choices"]["scheduler"]
            with open(folder / "requests.csv", newline="") as handle:
                finish_steps[scheduler] = [int(r["finished_step"]) for r in csv.DictReader(handle)]
    assert set(finish_steps) == {"continuous", "mlfq"}
    for measure in (statistics.mean, statistics.median):
        assert measure(finish_steps["mlfq"]) < 0.9 * measure(finish_steps["continuous"])


def test_speculative_decoding_on_a_trained_pair(tmp_path):
    """The preset on a seconds-long trained pair (`spec_pair.py --quick`, found
    through $HOME as the preset reads it): every proposer gives no speculation's
    tokens; on the copy-heavy edit, n-gram lookup keeps several drafts per
    verification and needs fewer steps; the speculation plot is drawn."""
    from tests.benchmark_scripts import quick_pair_home

    runs = run_preset(tmp_path, "speculative_decoding", "engine.max_num_seqs=1,4",
                      "workload=spec_pair_code_edit", "engine.num_threads=1",
                      env=quick_pair_home(tmp_path / "home"))  # fmt: skip
    proposers = ("none", "pair_ngram", "pair_draft", "pair_eagle")
    assert set(runs) == {f"{p}/{b}" for p in proposers for b in (1, 4)}, set(runs)
    for batch in (1, 4):
        plain = runs[f"none/{batch}"]
        for proposer in proposers[1:]:
            run = runs[f"{proposer}/{batch}"]
            assert run["output_digest"] == plain["output_digest"], (proposer, batch)
            assert run["spec_draft_tokens"] > 0
    assert runs["pair_ngram/1"]["spec_mean_accepted_length"] > 1.5
    assert runs["pair_ngram/1"]["steps"] < 0.8 * runs["none/1"]["steps"]
    plot = tmp_path / "speculative_decoding" / "speculation.png"
    assert plot.exists() and Image.open(plot).size[0] > 400


def test_kv_tiers(tmp_path):
    """Fewer chats than the preset's (their histories still outgrow the 1k-token cache):
    every tier gives no tier's tokens and computes at most 0.6 of its prompt tokens, and
    each run's disk blocks are in that run's own folder, so every run starts cold."""
    runs = run_preset(tmp_path, "kv_tiers", "workload.num_conversations=8",
                      "engine.num_threads=1")  # fmt: skip
    none = runs["none"]
    assert str(none["tier_hit_rate"]) in ("nan", "") and none["prefix_hit_tokens"] > 0
    for tier in ("host", "disk", "tiered"):
        run = runs[tier]
        assert run["output_digest"] == none["output_digest"], tier
        assert run["prefill_tokens"] <= 0.6 * none["prefill_tokens"], tier
        assert run["tier_hit_rate"] > 0, tier
    folders = sorted((tmp_path / "kv_tiers").glob("*/kv_blocks"))
    assert len(folders) == 2 and all(any(f.iterdir()) for f in folders)  # disk and tiered
