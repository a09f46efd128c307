"""Decode graphs under tensor parallelism, on the CPU: every rank captures the
same buckets in the same order, every rank replays the same bucket at the same
step (a mismatch would pair all-reduces of different sizes: an error or a
hang), and the tokens are still transformers' greedy tokens.

CUDA graphs need a CUDA device, so the graphs are stood in for by
`ForwardReplay` (decode_scenes.py: a "replay" reruns the recorded forward,
all-reduces included, on the static buffers), on rank 0 and on the worker.
That patch has to reach the worker's interpreter, so the two ranks run under
`torchrun`, each importing the stand-in before servelab builds anything.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from servelab import LLM
from servelab.testing.oracle import cached_case, restored_num_threads
from servelab.testing.oracle import engine_options as oracle_engine_options
from tests.executor.decode_scenes import skip_unless_triton_interpreted
from tests.executor.tp_helpers import (  # noqa: F401
    no_stray_workers,
    one_group_then_none,
    run_torchrun,
)

ROOT = Path(__file__).resolve().parents[2]
PARTS = dict(
    scheduler={"name": "continuous", "admission": "on_demand"},
    allocator={"name": "paged", "block_size": 4},
    attention="triton_paged",  # the graph-safe backend (interpreted here)
)
NUM_PROMPTS = 6

PROGRAM = """
import json, os, pickle, sys
sys.path.insert(0, sys.argv[1])  # the repository: the tests' stand-in for CUDA graphs
import servelab.executor.model_runner as model_runner
import servelab.executor.parallel.worker as worker
from tests.executor.decode_scenes import CpuReplayRunner

rank = int(os.environ["RANK"])
log_path = os.path.join(sys.argv[2], f"rank{rank}.jsonl")


class RecordedReplays(CpuReplayRunner):
    \"\"\"Writes, per forward, the bucket it replays (null: eager).\"\"\"

    def capture(self):
        super().capture()
        with open(log_path, "a") as log:
            log.write(json.dumps({"captured": self.__dict__.get("captured", [])}) + "\\n")

    def run(self, input_ids, meta, attn_plan=None):
        with open(log_path, "a") as log:
            log.write(json.dumps({"step": self.bucket_for(meta)}) + "\\n")
        return super().run(input_ids, meta, attn_plan)


model_runner.DecodeGraphRunner = worker.DecodeGraphRunner = RecordedReplays
from servelab import LLM
from servelab.executor.parallel.worker import serve_worker

if serve_worker(device="cpu"):
    raise SystemExit
with open(os.path.join(sys.argv[2], "job.pkl"), "rb") as f:
    job = pickle.load(f)
llm = LLM(model=job["folder"], **job["parts"], **job["engine"])
print("status", llm.engine.executor.runner.graphs_status, flush=True)
outputs = llm.generate(job["prompts"], job["params"])
print("tokens", json.dumps([o.outputs[0].token_ids for o in outputs]), flush=True)
"""


def read_log(path: Path) -> tuple[list[int], list[int | None]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    captured = [r["captured"] for r in records if "captured" in r]
    assert len(captured) == 1, records
    return captured[0], [r["step"] for r in records if "step" in r]


def test_every_rank_captures_and_replays_the_same_buckets(tmp_path):
    skip_unless_triton_interpreted()
    case = cached_case("qwen3")
    engine = oracle_engine_options(
        PARTS, cuda_graphs=True, tensor_parallel_size=2, max_num_seqs=4, num_threads=1
    )
    job = dict(
        folder=str(case.folder),
        parts=PARTS,
        engine=engine,
        prompts=case.prompts[:NUM_PROMPTS],
        params=case.params[:NUM_PROMPTS],
    )
    (tmp_path / "job.pkl").write_bytes(pickle.dumps(job))
    result = run_torchrun(tmp_path, PROGRAM, str(ROOT), str(tmp_path), timeout=420)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["status"].startswith("captured: batch sizes [1, 2, 4]"), lines["status"]

    tokens = json.loads(lines["tokens"])
    assert tokens == case.expected[:NUM_PROMPTS]  # transformers' greedy tokens
    # and the single-process engine's, without graphs
    single = LLM(model=str(case.folder), **PARTS, **oracle_engine_options(PARTS, max_num_seqs=4))
    with restored_num_threads(1):
        alone = single.generate(case.prompts[:NUM_PROMPTS], case.params[:NUM_PROMPTS])
    assert tokens == [o.outputs[0].token_ids for o in alone]

    captured0, steps0 = read_log(tmp_path / "rank0.jsonl")
    captured1, steps1 = read_log(tmp_path / "rank1.jsonl")
    assert captured0 == captured1 == [4, 2, 1]  # largest first, on both ranks
    assert steps0 == steps1  # the same bucket (or eager) at every step, on both ranks
    replayed = [b for b in steps0 if b is not None]
    assert replayed and len(replayed) < len(steps0)  # decode steps replayed, prefills eager
    assert len(set(replayed)) > 1  # more than one bucket size was replayed
