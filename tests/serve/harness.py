"""A tiny text model folder (byte-level BPE tokenizer, chat template) and a real
uvicorn server on a free 127.0.0.1 port, run on a thread of the test process."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

from servelab.serve.server import Server

CORPUS = ["hello world, servelab serves tokens", "the quick brown fox jumps over the lazy dog",
          "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber \u65e5\u672c\u8a9e \U0001f600"] * 4  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB = 384


def text_model_folder(folder: Path, chat_template: bool = True) -> Path:
    """Saves a 1-layer random Qwen3 with a tokenizer.json (and a chat template)."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=320, min_frequency=1, show_progress=False)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=256, eos_token_id=None)  # fmt: skip
    with torch.random.fork_rng():  # the same weights every session, the tests' RNG untouched
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>"}
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_config(model, serve: dict | None = None, **parts) -> dict:
    engine = {"dtype": "float64", "max_model_len": 256, **parts.pop("engine", {})}
    return {"model": model, **parts, "engine": engine,
            "serve": {"port": free_port(), "log_level": "warning", **(serve or {})}}  # fmt: skip


class Running:
    """`with Running(config) as server:` a live server; stops and joins on exit."""

    def __init__(self, config: dict) -> None:
        self.server = Server(config)
        self.url = f"http://127.0.0.1:{self.server.options['port']}"

    def __enter__(self) -> Server:
        self.server.aengine.start()
        self.uv = self.server.make_uvicorn()
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert time.monotonic() < deadline, "the server did not start in 30 s"
            assert self.thread.is_alive(), "the server thread died"
            time.sleep(0.02)
        self.server.url = self.url
        return self.server

    def __exit__(self, *exc) -> None:
        self.uv.should_exit = True
        self.thread.join(30)
        self.server.aengine.stop()


def boundary_stop(tok, ids: list[int]) -> tuple[str, int]:
    """A two-character stop string spanning a token boundary of `ids` (the last
    character of one token's text, the first of the next), first appearing when
    that next token arrives; and how many tokens a run stopped by it keeps."""
    for i in range(1, len(ids)):
        before, after = tok.decode(ids[:i]), tok.decode(ids[: i + 1])
        stop = after[len(before) - 1 : len(before) + 1]
        if (after.startswith(before) and len(before) >= 1 and len(stop) == 2
                and "\ufffd" not in stop and stop not in before):  # fmt: skip
            return stop, i + 1
    raise AssertionError("no clean token boundary in the output")
