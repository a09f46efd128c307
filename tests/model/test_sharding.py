"""Tensor-parallel shards without processes: which shapes split, and that every
rank's weights are exactly its slice of the whole model's, from a checkpoint
(read slice by slice) and from seeded random weights."""

from __future__ import annotations

import pytest
import torch

from servelab.errors import ConfigError
from servelab.model.config import named_config
from servelab.model.loader import init_random_weights, load_model
from servelab.model.sharding import Shard, check_tensor_parallel
from servelab.model.transformer import Transformer
from servelab.testing.hf_reference import build_tiny_hf


def test_shapes_that_split_and_those_that_do_not():
    tiny = named_config("tiny")  # 4 heads, 2 KV heads, MLP 128
    check_tensor_parallel(tiny, 2)  # KV heads split, one per rank
    check_tensor_parallel(tiny, 4)  # KV heads replicated, each on 2 ranks
    with pytest.raises(ConfigError, match="its 4 attention heads"):
        check_tensor_parallel(tiny, 3)
    with pytest.raises(ConfigError, match="its 3 KV heads .a multiple of the ranks"):
        check_tensor_parallel(tiny.replace(num_heads=6, num_kv_heads=3, intermediate_size=6), 2)
    with pytest.raises(ConfigError, match="its 2 KV heads .the ranks a multiple of them"):
        check_tensor_parallel(tiny.replace(num_heads=6, num_kv_heads=2, intermediate_size=6), 3)
    with pytest.raises(ConfigError, match="its MLP width 129"):
        check_tensor_parallel(tiny.replace(intermediate_size=129), 2)


@pytest.mark.parametrize("size, kv_heads", [(2, [[0], [1]]), (4, [[0], [0], [1], [1]])])
def test_kv_heads_per_rank(size, kv_heads):
    tiny = named_config("tiny")
    for rank, want in enumerate(kv_heads):
        shard = Shard(tiny, rank, size)
        held = list(range(shard.kv_head_start, shard.kv_head_start + shard.num_kv_heads))
        assert held == want
        # every query head of the rank reads a KV head the rank holds (GQA groups)
        group = tiny.num_heads // tiny.num_kv_heads
        q_heads = range(rank * tiny.num_heads // size, (rank + 1) * tiny.num_heads // size)
        assert {q // group for q in q_heads} <= set(held)


def expected_slice(name: str, full: torch.Tensor, rank: int, size: int, config) -> torch.Tensor:
    """The rank's part of `full`, written out per projection (independently of `Shard`)."""
    d, heads, kv = config.head_dim, config.num_heads, config.num_kv_heads
    proj = name.split(".")[-2]
    if proj == "q_proj":
        return full.chunk(size, dim=0)[rank]
    if proj in ("k_proj", "v_proj"):
        per_head = full.view(kv, d, *full.shape[1:])
        head = rank * kv // size if kv >= size else rank // (size // kv)
        count = max(1, kv // size)
        return per_head[head : head + count].reshape(count * d, *full.shape[1:])
    if proj in ("gate_proj", "up_proj"):
        return full.chunk(size, dim=0)[rank]
    if proj in ("o_proj", "down_proj") and name.endswith("weight"):
        return full.chunk(size, dim=1)[rank]
    if proj == "o_proj" and name.endswith("bias"):
        return full if rank == 0 else torch.zeros_like(full)
    if proj in ("embed_tokens", "lm_head"):  # token rows, the last rank's padded with zeros
        rows = -(-config.vocab_size // size)
        part = full[rank * rows : (rank + 1) * rows]
        padding = full.new_zeros(rows - part.shape[0], *full.shape[1:])
        return torch.cat([part, padding])
    assert heads  # replicated
    return full


@pytest.mark.parametrize("arch, kv, size", [("qwen3", 2, 2), ("qwen2", 2, 2), ("llama", 1, 2)])
def test_checkpoint_shards_are_slices_of_the_whole(tmp_path, arch, kv, size):
    build_tiny_hf(arch, num_kv_heads=kv).save_pretrained(tmp_path, safe_serialization=True)
    whole, config, _ = load_model(str(tmp_path), "float64")
    full = dict(whole.named_parameters())
    for rank in range(size):
        part, part_config, _ = load_model(str(tmp_path), "float64", shard=(rank, size))
        assert part_config == config  # the whole model's shape, for the engine
        assert part.config.num_heads == config.num_heads // size
        for name, param in part.named_parameters():
            want = expected_slice(name, full[name], rank, size, config)
            assert torch.equal(param, want), f"rank {rank}: {name}"


def test_random_weights_and_row_parallel_bias_sum_to_the_whole():
    """Seeded random weights: each rank's slice of the same model; o_proj's bias is
    added once, so the ranks' partial o_proj outputs sum to the whole one."""
    config = named_config("tiny").replace(attention_bias=True, o_proj_bias=True)
    whole = Transformer(config, torch.float64)
    init_random_weights(whole, seed=3)
    x = torch.randn(5, config.num_heads * config.head_dim, dtype=torch.float64)
    partial_sum = torch.zeros(5, config.hidden_size, dtype=torch.float64)
    for rank in range(2):
        shard = Shard(config, rank, 2)
        part = Transformer(shard.local_config, torch.float64)
        init_random_weights(part, seed=3, shard=shard)
        full = dict(whole.named_parameters())
        for name, param in part.named_parameters():
            assert torch.equal(param, expected_slice(name, full[name], rank, 2, config)), name
        o_proj = part.model.layers[0].self_attn.o_proj
        partial_sum += o_proj(x.chunk(2, dim=1)[rank])
    want = whole.model.layers[0].self_attn.o_proj(x)
    torch.testing.assert_close(partial_sum, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("vocab_size", [512, 509])  # split evenly, and with the last rank padded
def test_vocab_parallel_embeddings_sum_and_logits_join_to_the_whole(vocab_size):
    config = named_config("tiny").replace(vocab_size=vocab_size, tie_word_embeddings=False)
    whole = Transformer(config, torch.float64)
    init_random_weights(whole, seed=4)
    ids = torch.tensor([0, 1, 255, 256, 257, vocab_size - 1, 7, 256])  # both sides of the split
    hidden = torch.randn(3, config.hidden_size, dtype=torch.float64)
    embedded, chunks = 0, []
    for rank in range(2):
        shard = Shard(config, rank, 2)
        part = Transformer(shard.local_config, torch.float64, vocab_start=shard.vocab_start)
        init_random_weights(part, seed=4, shard=shard)
        part.set_all_reduce(lambda t: t)  # one rank's share; the sum below is the all-reduce
        embedded = embedded + part.model.embed_tokens(ids)
        chunks.append(part.compute_logits(hidden))
    assert torch.equal(embedded, whole.model.embed_tokens(ids))  # one nonzero row per token
    joined = torch.cat(chunks, dim=-1)
    assert joined.shape == (3, 2 * -(-vocab_size // 2))
    torch.testing.assert_close(joined[:, :vocab_size], whole.compute_logits(hidden), rtol=0,
                               atol=1e-12)  # fmt: skip
    assert not joined[:, vocab_size:].any()  # the padding rows' logits, cut off by rank 0
