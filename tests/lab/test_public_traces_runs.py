"""Public traces served: a Mooncake trace's prefix hits are the block
arithmetic its hash ids imply, a bad file exits the `servelab` command with
its one-line error (exit code 2, no traceback), a run's provenance names the
trace file and its hash, and the two presets on public workloads run end to
end at a reduced size with their claims holding."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from servelab.engine.build import build_engine
from servelab.lab.workload import make_workload
from tests.lab.test_presets import run_preset

SERVELAB = Path(sys.executable).parent / "servelab"
TRACE_BLOCK = 32  # the trace's block size here (the published traces: 512)
# the second shares ids 0 and 1 with the first (64 tokens); the third 0, 1 and 2 (96); the
# fourth nothing; the fifth 0, 1 and 4 with the second, whose 90 tokens end inside block 4:
# 90 shared tokens, 80 of them in whole 16-token pages
MOONCAKE = [
    (0, 100, 3, [0, 1, 2, 3]),
    (1500, 90, 2, [0, 1, 4]),
    (2250, 120, 4, [0, 1, 2, 5]),
    (3000, 40, 1, [6, 7]),
    (3100, 110, 2, [0, 1, 4, 8]),
]


def mooncake_file(folder: Path, rows=MOONCAKE, name="trace.jsonl") -> Path:
    path = folder / name
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids})
            + "\n"
            for t, n, o, ids in rows
        )
    )
    return path


def expected_hits(rows, block: int, page: int) -> list[int]:
    """Per request, served one at a time with nothing evicted: the tokens it shares
    with the earlier prompt it shares most with (k equal leading ids share k blocks,
    as far as both prompts reach), rounded down to the cache's page of `page` tokens."""
    hits = []
    for i, (_, length, _, ids) in enumerate(rows):
        shared = 0
        for _, earlier_length, _, earlier in rows[:i]:
            k = 0
            while k < min(len(ids), len(earlier)) and ids[k] == earlier[k]:
                k += 1
            shared = max(shared, min(k * block, length, earlier_length))
        hits.append(min(shared, length - 1) // page * page)
    return hits


@pytest.mark.parametrize(
    "allocator,page,by_hand",
    [
        ({"name": "paged", "block_size": 16, "prefix_caching": True}, 16, [0, 64, 96, 0, 80]),
        ({"name": "radix"}, 1, [0, 64, 96, 0, 90]),
    ],
    ids=["paged_hashed", "radix"],
)
def test_mooncake_prefix_hits_are_the_hash_id_block_arithmetic(tmp_path, allocator, page, by_hand):
    engine = build_engine(
        {
            "model": "tiny",
            "allocator": allocator,
            "executor": "simulated",
            "hardware": "cpu-local",
            "engine": {"max_model_len": 256, "max_num_seqs": 1},
        }
    )
    requests = make_workload(
        {"name": "mooncake", "path": str(mooncake_file(tmp_path)), "block_size": TRACE_BLOCK},
        engine.model_config.vocab_size,
        engine.max_model_len,
    )
    hits = []
    for req in requests:  # one at a time: each finds everything before it cached
        before = sum(s.prefix_hit_tokens for s in engine.metrics.steps)
        engine.add_request(req.prompt_token_ids, req.params, request_id=req.request_id)
        while engine.has_unfinished():
            engine.step()
        hits.append(sum(s.prefix_hit_tokens for s in engine.metrics.steps) - before)
    assert expected_hits(MOONCAKE, TRACE_BLOCK, page) == by_hand
    assert hits == by_hand


def servelab(*args: str) -> subprocess.CompletedProcess:
    command = (
        [str(SERVELAB)]
        if SERVELAB.exists()
        else [sys.executable, "-c", "from servelab.cli import main; main()"]
    )
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300)


SIMULATED = ["executor=simulated", "hardware=cpu-local", "run.progress=false"]
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BAD_FILES = [
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n", ":1: missing column"),
    (AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.0000000,many,4\n",
     ":3: ContextTokens is not a whole number: 'many'"),
    (AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\nyesterday,396,109\n",
     ":3: TIMESTAMP is not a date-time"),
]  # fmt: skip


@pytest.mark.parametrize("text,problem", BAD_FILES, ids=["column", "count", "timestamp"])
def test_a_bad_file_exits_2_with_one_line(tmp_path, text, problem):
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    path.write_text(text)
    done = servelab("workload=azure_llm", f"workload.path={path}", f"hydra.run.dir={tmp_path}",
                    *SIMULATED)  # fmt: skip
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"servelab: error: {path}{problem}")


def test_a_run_records_the_trace_its_hash_and_the_caps(tmp_path):
    path = mooncake_file(tmp_path)
    done = servelab("workload=mooncake", f"workload.path={path}", "workload.block_size=32",
                    "workload.max_input_len=96", "workload.time_scale=0.001",
                    f"hydra.run.dir={tmp_path / 'run'}", *SIMULATED)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    trace = results["provenance"]["workload_trace"]
    assert trace["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert trace["file"] == "trace.jsonl" and trace["trace"] == "mooncake"
    assert trace["requests"] == 5 and trace["capped_input"] == 3  # 100, 120 and 110 tokens
    assert results["summary"]["requests"] == 5


# -- the presets, at a reduced size, on files written in the published formats


def mooncake_sessions(folder: Path, n: int = 40, seed: int = 3) -> Path:
    """Chats that resend their history: each turn's ids are the previous turn's plus new ones,
    behind a shared 2-block system prompt (a Mooncake trace's kind of reuse)."""
    rng = np.random.default_rng(seed)
    next_id, chats, rows = 2, [], []
    for i in range(n):
        if len(chats) < 4 or rng.random() < 0.3:
            chats.append([0, 1])
        chat = int(rng.integers(len(chats)))
        grow = int(rng.integers(1, 4))
        chats[chat] = chats[chat] + list(range(next_id, next_id + grow))
        next_id += grow
        ids = chats[chat]
        rows.append((i * 400, (len(ids) - 1) * 512 + int(rng.integers(1, 513)),
                     int(rng.integers(20, 200)), ids))  # fmt: skip
    return mooncake_file(folder, rows, "conversation_trace.jsonl")


def azure_conversation(folder: Path, n: int = 160, seed: int = 4) -> Path:
    """A conversation-like trace: log-normal lengths around 1000 and 130 tokens, gamma gaps."""
    rng = np.random.default_rng(seed)
    start, t, lines = datetime(2023, 11, 16, 18, 15, 46), 0.0, [AZURE_HEADER]
    for _ in range(n):
        t += rng.gamma(0.5, 0.4)
        when = start + timedelta(seconds=t)
        context = int(min(7000, max(2, rng.lognormal(np.log(1020), 0.75))))
        generated = int(min(1000, max(1, rng.lognormal(np.log(130), 0.9))))
        lines.append(f"{when:%Y-%m-%d %H:%M:%S}.{when.microsecond:06d}0,{context},{generated}\n")
    path = folder / "AzureLLMInferenceTrace_conv.csv"
    path.write_text("".join(lines))
    return path


def test_prefix_caching_mooncake_preset(tmp_path):
    path = mooncake_sessions(tmp_path)
    runs = run_preset(tmp_path, "prefix_caching_mooncake", f"workload.path={path}",
                      "workload.num_requests=40")  # fmt: skip
    off, hashed, radix = (runs[f"{cache}/{allocator}"] for cache, allocator in
                          (("off", "paged"), ("hashed", "paged"), ("radix", "radix")))  # fmt: skip
    assert off["prefix_hit_rate"] == 0
    assert hashed["prefill_tokens"] <= 0.8 * off["prefill_tokens"]
    assert radix["prefill_tokens"] <= 0.8 * off["prefill_tokens"]
    assert radix["prefix_hit_rate"] >= 0.95 * hashed["prefix_hit_rate"]
    assert hashed["ttft_p50_ms"] < off["ttft_p50_ms"]
    summary = (tmp_path / "prefix_caching_mooncake" / "summary.md").read_text()
    assert "fails" not in summary and "![workload](workload.png)" in summary
    with Image.open(tmp_path / "prefix_caching_mooncake" / "workload.png") as image:
        assert image.width > 1000  # three panels side by side


def test_capacity_azure_h100_preset(tmp_path):
    path = azure_conversation(tmp_path)
    runs = run_preset(tmp_path, "capacity_azure_h100", f"workload.path={path}",
                      "workload.num_requests=160", "workload.rate=2,8")  # fmt: skip
    assert runs["chunked/2"]["slo_attainment_pct"] >= 90
    chunked, continuous = runs["chunked/8"], runs["continuous/8"]  # at 8 requests/s
    assert continuous["slo_attainment_pct"] <= 90
    assert chunked["goodput_rps"] >= 1.5 * continuous["goodput_rps"]
    summary = (tmp_path / "capacity_azure_h100" / "summary.md").read_text()
    assert "![workload](workload.png)" in summary
