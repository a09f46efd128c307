"""Loader and config: named shapes, determinism, checkpoint errors, dtypes, tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from servelab.errors import ConfigError
from servelab.model import tiny_tokenizer
from servelab.model.config import NAMED_SHAPES, ModelConfig, named_config, resolve_dtype
from servelab.model.loader import load_model
from servelab.model.transformer import Transformer
from tests.helpers_model import PagedDriver

SMALL_SHAPES = ["tiny", "tiny-llama", "tiny-qwen2", "bench"]


def hf_config_dict(**overrides) -> dict:
    """A Llama-style config.json as transformers 4.x writes it."""
    d = dict(
        model_type="llama",
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    d.update(overrides)
    return d


def write_checkpoint(folder, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return str(folder)


def random_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    model = Transformer(ModelConfig.from_hf_dict(config), torch.float32)
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


# -- named shapes
@pytest.mark.parametrize("name", SMALL_SHAPES)
def test_named_shape_builds_runs_and_is_deterministic(name):
    model, config, tokenizer = load_model(name, "float32", "cpu", seed=3)
    assert (tokenizer is None) == (name not in tiny_tokenizer.SHAPES)  # the tiny shapes have one
    assert config == named_config(name)
    again, _, _ = load_model(name, "float32", "cpu", seed=3)
    other, _, _ = load_model(name, "float32", "cpu", seed=4)
    state, same, different = model.state_dict(), again.state_dict(), other.state_dict()
    assert state.keys() == same.keys()
    assert all(torch.equal(state[k], same[k]) for k in state)
    assert not any(torch.equal(state[k], different[k]) for k in state)
    (logits,) = PagedDriver(model).step([(0, [5, 9, 2, 7])])
    assert logits.shape == (4, config.vocab_size) and torch.isfinite(logits).all()


def test_random_weights_do_not_depend_on_dtype():
    wide, _, _ = load_model("tiny", "float64", "cpu", seed=0)
    narrow, _, _ = load_model("tiny", torch.float32, "cpu", seed=0)
    for (name, a), (_, b) in zip(wide.named_parameters(), narrow.named_parameters(), strict=True):
        assert a.dtype == torch.float64 and b.dtype == torch.float32
        assert torch.equal(a.float(), b), name


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 0.03), ("float16", 5e-3)])
def test_low_precision_logits_track_float64(dtype, atol):
    tokens = [5, 9, 2, 7, 11, 3]
    wide, _, _ = load_model("tiny", "float64", seed=0)
    narrow, _, _ = load_model("tiny", dtype, seed=0)
    (reference,) = PagedDriver(wide).step([(0, tokens)])
    (logits,) = PagedDriver(narrow).step([(0, tokens)])
    assert logits.dtype == narrow.dtype
    torch.testing.assert_close(logits.double(), reference, rtol=0, atol=atol)


def test_named_shapes_match_the_brief():
    tiny = named_config("tiny")
    assert (tiny.architecture, tiny.num_layers, tiny.hidden_size, tiny.num_heads) == (
        "qwen3",
        2,
        64,
        4,
    )
    assert (tiny.num_kv_heads, tiny.head_dim, tiny.intermediate_size, tiny.vocab_size) == (
        2,
        16,
        128,
        512,
    )
    assert tiny.qk_norm and not tiny.tie_word_embeddings and tiny.eos_token_ids == [1]
    assert named_config("tiny-llama").tie_word_embeddings
    assert named_config("tiny-qwen2").attention_bias
    bench = named_config("bench")
    assert (bench.num_layers, bench.hidden_size, bench.head_dim, bench.vocab_size) == (
        4,
        256,
        64,
        1024,
    )


def test_qwen3_0_6b_shape_matches_the_published_parameter_count():
    # Built on the meta device: shapes only, no memory
    model = Transformer(named_config("qwen3-0.6b"), torch.bfloat16, device="meta")
    total = sum(p.numel() for p in model.parameters())
    embedding = 151936 * 1024
    # the model card: 0.6B parameters, 0.44B of them non-embedding (tied LM head)
    assert model.lm_head is None
    assert round(total / 1e9, 1) == 0.6 and round((total - embedding) / 1e9, 2) == 0.44


def test_unknown_shape_lists_the_names():
    with pytest.raises(ConfigError) as err:
        named_config("huge")
    for name in NAMED_SHAPES:
        assert name in str(err.value)
    with pytest.raises(ConfigError, match="tiny-llama"):
        load_model("no-such-model-or-folder")


# -- checkpoints
def test_checkpoint_round_trip(tmp_path):
    config = hf_config_dict()
    tensors = random_state_dict(config)
    model, loaded, _ = load_model(write_checkpoint(tmp_path, config, tensors), "float64")
    assert loaded.head_dim == 8 and loaded.eos_token_ids == [2] and loaded.rope_theta == 500000.0
    for name, param in model.named_parameters():
        assert param.dtype == torch.float64
        assert torch.equal(param, tensors[name].double()), name


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    config = hf_config_dict()
    tensors = random_state_dict(config)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    with pytest.raises(ConfigError) as err:
        load_model(write_checkpoint(tmp_path, config, tensors))
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "model.layers.0.mlp.extra.weight" in str(err.value)


def test_wrong_shape_is_named(tmp_path):
    config = hf_config_dict()
    tensors = random_state_dict(config)
    tensors["model.norm.weight"] = torch.ones(31)
    with pytest.raises(ConfigError, match=r"model\.norm\.weight.*\(31,\).*\(32,\)"):
        load_model(write_checkpoint(tmp_path, config, tensors))


def test_untied_checkpoint_without_lm_head_is_an_error(tmp_path):
    config = hf_config_dict()
    tensors = random_state_dict(config)
    del tensors["lm_head.weight"]
    with pytest.raises(ConfigError, match="lm_head.weight"):
        load_model(write_checkpoint(tmp_path, config, tensors))


def test_tied_checkpoint_may_carry_a_redundant_lm_head(tmp_path):
    config = hf_config_dict(tie_word_embeddings=True)
    tensors = random_state_dict(config)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    model, _, _ = load_model(write_checkpoint(tmp_path, config, tensors))
    assert model.lm_head is None


def test_sharded_index_is_followed(tmp_path):
    config = hf_config_dict()
    tensors = random_state_dict(config)
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _, _ = load_model(str(tmp_path))
    assert all(torch.equal(p, tensors[n]) for n, p in model.named_parameters())
    assert load_file(str(tmp_path / "a.safetensors")).keys() == set(shards["a.safetensors"])


# -- dtypes
def test_dtypes():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype("torch.float64") is torch.float64
    for bad in ("float8", "int32", torch.int64, None):
        with pytest.raises(ConfigError) as err:
            resolve_dtype(bad)
        for valid in ("float64", "float32", "bfloat16", "float16"):
            assert valid in str(err.value)
    with pytest.raises(ConfigError, match="bfloat16"):
        load_model("tiny", "fp8")


# -- config.json variants
def test_hf_config_defaults_and_variants():
    c = ModelConfig.from_hf_dict(
        hf_config_dict(num_key_value_heads=None, eos_token_id=[5, 6], model_type="qwen2")
    )
    assert c.num_kv_heads == 4 and c.head_dim == 8 and c.eos_token_ids == [5, 6]
    assert c.attention_bias and not c.o_proj_bias and not c.qk_norm
    qwen3 = ModelConfig.from_hf_dict(hf_config_dict(model_type="qwen3", head_dim=16))
    assert qwen3.qk_norm and qwen3.head_dim == 16
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    old_style = ModelConfig.from_hf_dict(hf_config_dict(rope_scaling=scaling))
    new_style = ModelConfig.from_hf_dict(
        hf_config_dict(rope_theta=None, rope_parameters={"rope_theta": 500000.0, **scaling})
    )
    assert old_style.rope_scaling == new_style.rope_scaling == scaling
    assert old_style.rope_theta == new_style.rope_theta == 500000.0


def test_hf_config_errors_name_the_supported_choices():
    with pytest.raises(ConfigError, match="default, llama3"):
        ModelConfig.from_hf_dict(hf_config_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ConfigError, match="qwen3, qwen2, llama"):
        ModelConfig.from_hf_dict(hf_config_dict(model_type="mistral"))
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        ModelConfig.from_hf_dict(hf_config_dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0}))  # fmt: skip


# -- tokenizer
def test_tokenizer_json_is_picked_up(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    config = hf_config_dict()
    folder = write_checkpoint(tmp_path, config, random_state_dict(config))
    _, _, none = load_model(folder)
    assert none is None
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    _, _, loaded = load_model(folder)
    assert loaded.encode("hello world nope").ids == [3, 4, 0]
