"""llama.cpp as `cpu_real_size.py`'s peer, run by the python of a venv with
llama-cpp-python (never servelab's: this file imports nothing of servelab).

`convert` turns the benchmark's Hugging Face checkpoint into a GGUF file with
llama.cpp's own converter (`convert_hf_to_gguf.py`). The checkpoint has no
tokenizer, and the converter takes a Qwen3 checkpoint's vocabulary from either a
SentencePiece `tokenizer.model` or a `tokenizer.json` whose pre-tokenizer it
recognises by hashing how it splits a fixed text, which only the real Qwen
tokenizer passes. So the converter reads the checkpoint through a staging folder
of links plus a small SentencePiece model trained here; requests come as token
ids, so its pieces are never used, and the converter pads the vocabulary with
unused entries up to the checkpoint's size.

`run` serves two workloads with llama.cpp's batched API (`llama_decode` over a
`llama_batch` whose tokens belong to many sequences): greedy (the logits'
argmax), every request to its `max_tokens` whatever it samples (EOS included).
All prompts are decoded first, up to `n_batch` tokens a call, then each step
decodes one token of every unfinished request. The K/V cache holds the model's
dtype (float32 or bfloat16) and is split, one buffer a sequence (`kv_unified`
off, llama.cpp's advice where sequences share no prefix: a unified one makes each
sequence's attention read every other sequence's K/V too). Printed: one JSON
line, the workload's tokens, wall and CPU seconds and their prefill / decode
split, with batch 1's under "batch1".

    PYTHON llama_cpp_peer.py convert CHECKPOINT OUT.gguf --outtype f32 --converter CONVERTER
    PYTHON llama_cpp_peer.py run OUT.gguf --workload W.json --batch1 B.json --threads 2 --dtype float32
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# ggml's type ids (ggml.h) for the K/V cache: the model's own dtype
KV_TYPE = {"float32": 0, "bfloat16": 30}
N_BATCH = 512
TOKENIZER_TEXT = [
    "a random-weight checkpoint needs a tokenizer only so that llama.cpp's converter accepts it",
    "requests arrive as token ids, so these pieces are never used to encode text",
]


def sentencepiece_model() -> bytes:
    """A small byte-fallback SentencePiece BPE: <unk>, <s>, </s>, 256 byte pieces, a few merges."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_TEXT), model_writer=model, vocab_size=300,
        model_type="bpe", byte_fallback=True, hard_vocab_limit=False, num_threads=1,
        minloglevel=2,
    )  # fmt: skip
    return model.getvalue()


def convert(checkpoint: Path, out: Path, outtype: str, converter: Path) -> None:
    """Writes `out` (through a temporary name beside it, so a failed run leaves none)."""
    with tempfile.TemporaryDirectory(prefix="gguf-stage-", dir=out.parent) as tmp:
        stage = Path(tmp) / checkpoint.name
        stage.mkdir()
        for f in checkpoint.iterdir():
            if f.suffix in (".json", ".safetensors"):
                (stage / f.name).symlink_to(f.resolve())
        (stage / "tokenizer.model").write_bytes(sentencepiece_model())
        partial = Path(tmp) / out.name
        cmd = [sys.executable, str(converter), str(stage), "--outtype", outtype,
               "--outfile", str(partial)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        os.replace(partial, out)


class Peer:
    """One GGUF model loaded once; a fresh context for each workload."""

    def __init__(self, gguf: Path, threads: int, dtype: str):
        import llama_cpp as ll

        self.ll, self.threads, self.dtype = ll, threads, dtype
        ll.llama_backend_init()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))

    def context(self, tokens: int, sequences: int):
        """A context for `sequences` sequences of up to `tokens` tokens each."""
        ll = self.ll
        params = ll.llama_context_default_params()
        params.n_ctx = tokens * sequences  # n_ctx / n_seq_max (rounded up to 256) each
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_seq_max = sequences
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = self.threads
        params.type_k = params.type_v = KV_TYPE[self.dtype]
        ctx = ll.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not make a context")
        return ctx

    def generate(self, ctx, requests: list[dict]) -> dict:
        """Every request's greedy tokens, the prefill and decode seconds, and the
        decode steps' token count (the first token of each comes with its prefill)."""
        ll = self.ll
        batch = ll.llama_batch_init(N_BATCH, 0, 1)
        out: list[list[int]] = [[] for _ in requests]

        def decode(entries: list[tuple[int, int, int, bool]]) -> None:
            """entries: (token, position, sequence, wants logits); appends the argmax
            of each row that wants logits to its sequence's tokens."""
            for i, (token, pos, seq, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.logits[i] = token, pos, logits
                batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
            batch.n_tokens = len(entries)
            if ll.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, seq, logits) in enumerate(entries):
                if logits:
                    row = ll.llama_get_logits_ith(ctx, i)
                    out[seq].append(int(np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax()))

        start, cpu_start = time.perf_counter(), time.process_time()
        prompt = [
            (t, pos, seq, pos == len(r["prompt"]) - 1)
            for seq, r in enumerate(requests)
            for pos, t in enumerate(r["prompt"])
        ]
        for k in range(0, len(prompt), N_BATCH):
            decode(prompt[k : k + N_BATCH])
        prefilled, cpu_prefilled = time.perf_counter(), time.process_time()
        steps = rows = 0
        while live := [s for s, r in enumerate(requests) if len(out[s]) < r["max_tokens"]]:
            decode(
                [(out[s][-1], len(requests[s]["prompt"]) + len(out[s]) - 1, s, True) for s in live]
            )
            steps, rows = steps + 1, rows + len(live)
        end, cpu_end = time.perf_counter(), time.process_time()
        ll.llama_batch_free(batch)
        return {"tokens": out, "wall_s": end - start, "prefill_s": prefilled - start,
                "decode_s": end - prefilled, "decode_steps": steps, "decode_rows": rows,
                "cpu_s": cpu_end - cpu_start, "decode_cpu_s": cpu_end - cpu_prefilled}  # fmt: skip

    def serve(self, requests: list[dict]) -> dict:
        ll = self.ll
        assert len(requests) <= N_BATCH, "a decode step's batch holds one token a request"
        ctx = self.context(max(len(r["prompt"]) + r["max_tokens"] for r in requests), len(requests))
        self.generate(ctx, [{"prompt": [1, 2, 3, 4], "max_tokens": 2}])  # warm-up
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        run = self.generate(ctx, requests)
        ll.llama_free(ctx)
        return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert")
    c.add_argument("checkpoint", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--outtype", choices=("f32", "bf16"), required=True)
    c.add_argument(
        "--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py"
    )
    r = sub.add_parser("run")
    r.add_argument("gguf", type=Path)
    r.add_argument("--workload", type=Path, required=True, help="the batched workload")
    r.add_argument("--batch1", type=Path, required=True, help="one request, served alone")
    r.add_argument("--threads", type=int, required=True)
    r.add_argument("--dtype", choices=tuple(KV_TYPE), required=True)
    args = p.parse_args(argv)
    if args.command == "convert":
        convert(args.checkpoint, args.out, args.outtype, args.converter)
        return 0
    peer = Peer(args.gguf, args.threads, args.dtype)
    batch1 = peer.serve(json.loads(args.batch1.read_text()))
    run = peer.serve(json.loads(args.workload.read_text()))
    run.update(output_tokens=sum(map(len, run["tokens"])), batched=True, batch1=batch1)
    print(json.dumps(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
