"""What a new user meets in the first hour, each checked: a misspelt part or
workload option lists the valid keys (the Python API's message), the Triton
interpreter is announced once with its speed, kernel builds are announced
through servelab's own log handler, progress is plain lines when output is not
a terminal, and `max_model_len` comes from the checkpoint."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from safetensors.torch import save_file

from servelab.cli import open_node_message
from servelab.engine.build import build_engine
from servelab.errors import ConfigError
from servelab.lab.progress import Progress
from servelab.lab.workload import make_workload
from servelab.model.config import ModelConfig
from servelab.model.transformer import Transformer
from servelab.registry.construct import construct


def composition_error(*overrides: str) -> Exception:
    GlobalHydra.instance().clear()
    with initialize_config_module("servelab.conf", version_base="1.3"):
        with pytest.raises(Exception) as caught:
            compose("config", overrides=list(overrides))
    GlobalHydra.instance().clear()
    return caught.value


@pytest.mark.parametrize(
    "overrides, python_api",
    [
        (["scheduler=chunked", "scheduler.chunk_sise=3"],
         lambda: construct("scheduler", {"name": "chunked", "chunk_sise": 3})),
        (["workload.num_requests=4"],
         lambda: make_workload({"name": "mixed_lengths", "num_requests": 4}, 100)),
        (["-m", "scheduler=static,chunked", "allocator.blok_size=8"],
         lambda: construct("allocator", {"name": "paged", "blok_size": 8})),
    ],
)  # fmt: skip
def test_a_misspelt_option_lists_the_valid_keys_as_the_python_api_does(overrides, python_api):
    # what Hydra raises for the command line (a sweep's first job composes one value)
    err = composition_error(*[o.split(",")[0] for o in overrides if not o.startswith("-")])
    assert "not in struct" in str(err.__cause__ or err) or "not in struct" in repr(err)
    with pytest.raises(ConfigError) as api:
        python_api()
    message = open_node_message(err, overrides)
    assert message == str(api.value) and "accepted: " in message


def test_the_triton_interpreter_is_announced_once_with_its_speed(caplog):
    from servelab.plugins.attention import triton_paged

    triton_paged.warn_interpreted.cache_clear()
    with caplog.at_level(logging.WARNING, logger="servelab"):
        triton_paged.warn_interpreted()
        triton_paged.warn_interpreted()
    warned = [r for r in caplog.records if "Triton interpreter" in r.getMessage()]
    assert len(warned) == 1 and "tokens/s" in warned[0].getMessage()
    assert "flash_varlen" in warned[0].getMessage()  # and what to use instead


def test_kernel_builds_are_announced_where_no_logging_is_configured(monkeypatch):
    from servelab.kernels.cpp_extension import announce_handler, log

    handler = announce_handler()
    assert announce_handler() is handler  # installed once
    stream = io.StringIO()
    monkeypatch.setattr(handler, "stream", stream)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # a script calling LLM(): no logging set up
    log.info("servelab: compiling servelab_cpu_linear into /cache (once per key)")
    assert "compiling servelab_cpu_linear" in stream.getvalue()
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])  # Hydra, a server: theirs
    log.info("servelab: compiling again")
    assert "again" not in stream.getvalue()


def test_progress_is_plain_lines_when_output_is_not_a_terminal():
    stream = io.StringIO()  # a log file: not a terminal
    with Progress("serving", 20, stream=stream, every=1e9, share=0.25) as progress:
        for _ in range(20):
            progress.advance("requests", detail="12.0 tok/s")
    lines = stream.getvalue().splitlines()
    # one line per quarter of the job, the last at the end
    assert [line.split()[1] for line in lines] == ["5/20", "10/20", "15/20", "20/20"]
    assert all("tok/s" in line for line in lines) and "\x1b" not in stream.getvalue()
    quiet = io.StringIO()
    with Progress("serving", 20, enabled=False, stream=quiet) as progress:
        progress.advance()
    assert quiet.getvalue() == ""


def checkpoint(folder, max_positions: int) -> None:
    hf = dict(
        model_type="llama", vocab_size=48, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=max_positions, tie_word_embeddings=False,
        eos_token_id=2,
    )  # fmt: skip
    model = Transformer(ModelConfig.from_hf_dict(hf), torch.float32)
    (folder / "config.json").write_text(json.dumps(hf))
    save_file({n: torch.randn(p.shape) for n, p in model.named_parameters()},
              str(folder / "model.safetensors"))  # fmt: skip


def test_max_model_len_comes_from_the_checkpoint(tmp_path):
    checkpoint(tmp_path, 512)
    small = {"kv_cache_memory": "1MiB"}
    engine = build_engine({"model": {"path": str(tmp_path)}, "engine": small})
    assert engine.max_model_len == 512  # not the 1024 that used to fail here
    assert build_engine({"model": "tiny", "engine": small}).max_model_len == 1024  # 4096: capped
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings=512"):
        build_engine({"model": {"path": str(tmp_path)}, "engine": {**small, "max_model_len": 1024}})
