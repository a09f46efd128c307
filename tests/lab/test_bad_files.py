"""A bad file is a ConfigError naming the file (and the line, for a trace),
never a raw decoder error; infinite or NaN times are refused where a trace or
a workload reads them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from servelab.errors import ConfigError
from servelab.lab.trace import trace_workload
from servelab.model.loader import load_model

VOCAB = 512


def write_trace(tmp_path, text: str | bytes):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize(
    "line,problem",
    [
        ('{"prompt_len": 4, "output_len": 2, "arrival_time": Infinity}', "Infinity is not a number JSON allows"),
        ('{"prompt_len": 4, "output_len": 2, "arrival_time": NaN}', "NaN is not a number JSON allows"),
        ('{"prompt_len": 4, "output_len": 2, "arrival_time": 1e400}', "arrival_time must be a finite number"),
        ('{"prompt_len": 4, "output_len": 2, "arrival_time": -1}', "arrival_time must be a finite number >= 0"),
        ('{"prompt_len": 4, "output_len": 2, "arrival_time": "soon"}', "arrival_time"),
        ('{"prompt_len": 4, "output_len": 2', "not valid JSON"),
    ],
)  # fmt: skip
def test_a_bad_trace_line_names_the_file_and_line(tmp_path, line, problem):
    path = write_trace(tmp_path, '{"prompt_len": 3, "output_len": 1}\n' + line + "\n")
    with pytest.raises(ConfigError, match=problem) as err:
        trace_workload(VOCAB, path=str(path))
    assert f"{path}:2" in str(err.value)


def test_a_trace_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = write_trace(tmp_path, b'{"prompt_len": 3, "output_len": 1}\n{"prompt_len": \xff}\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: not UTF-8 text \(byte 0xff\)"):
        trace_workload(VOCAB, path=str(path))


@pytest.mark.parametrize("scale", [-1, float("inf"), float("nan"), "2"])
def test_time_scale_must_be_finite_and_not_negative(tmp_path, scale):
    path = write_trace(tmp_path, '{"prompt_len": 3, "output_len": 1, "arrival_time": 1}\n')
    with pytest.raises(ConfigError, match="time_scale must be a finite number >= 0"):
        trace_workload(VOCAB, path=str(path), time_scale=scale)


def tiny_checkpoint(folder):
    """A checkpoint folder of the `tiny` shape (config.json + model.safetensors)."""
    model, config, _ = load_model("tiny", "float32", "cpu")
    hf = {
        "model_type": "qwen3", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings, "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings, "eos_token_id": 1,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(hf))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if "rope" not in k}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_the_checkpoint_helper_loads(tmp_path):
    model, _, _ = load_model(str(tiny_checkpoint(tmp_path)), "float32", "cpu")
    reference, _, _ = load_model("tiny", "float32", "cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize(
    "damage,problem",
    [
        (lambda f: (f / "config.json").write_text('{"model_type": "qwen3",'), "config.json: not valid JSON"),
        (lambda f: (f / "config.json").write_bytes(b"\xff\xfe"), "config.json: not valid JSON"),
        (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json: expected a JSON object"),
        (lambda f: (f / "config.json").write_text('{"model_type": "qwen3"}'), "config.json: missing or malformed field"),
        (lambda f: (f / "config.json").write_text('{"model_type": "gpt2"}'), "config.json: unsupported model_type"),
        (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:200]), "model.safetensors: not a readable safetensors file"),
        (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-100]), "model.safetensors"),
        (lambda f: (f / "tokenizer.json").write_text("{not json"), "tokenizer.json: not a readable tokenizer"),
    ],
    ids=["truncated-config", "binary-config", "config-not-object", "config-missing-field", "unsupported-architecture", "truncated-header", "truncated-tensors", "bad-tokenizer"],
)  # fmt: skip
def test_a_damaged_checkpoint_folder_names_the_file(tmp_path, damage, problem):
    folder = tiny_checkpoint(tmp_path)
    damage(folder)
    with pytest.raises(ConfigError, match=problem) as err:
        load_model(str(folder), "float32", "cpu")
    assert str(folder) in str(err.value)


def test_an_arrival_time_too_large_for_a_float_names_the_line(tmp_path):
    path = write_trace(
        tmp_path, '{"prompt_len": 3, "output_len": 1, "arrival_time": 1' + "0" * 400 + "}\n"
    )
    with pytest.raises(ConfigError, match=rf"{path}:1: arrival_time must be a finite number"):
        trace_workload(VOCAB, path=str(path))
