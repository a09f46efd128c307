"""servelab's decoder against Hugging Face transformers, in float64.

Each case builds a tiny random HF model, saves it (single file or sharded),
loads it with servelab's loader and drives it through a paged KV cache with
mixed steps (prefills, a chunked prefill, decodes). Every logit must equal
transformers' full forward over the same prefix within 1e-9.

transformers computes RMSNorm and RoPE in float32 even for a float64 model;
servelab keeps a float64 model in float64. So the HF reference gets exact
float64 norms and RoPE (frequencies from an independent scalar formula) patched
in by `servelab.testing.hf_reference`; everything else — projections, biases,
q/k norms, GQA, SDPA, MLP, the LM head — is transformers' own code.
"""

from __future__ import annotations

import json

import pytest
import torch

from servelab.executor.forward import cpu_kernel_problems
from servelab.executor.kernel_forward import KernelForward
from servelab.model.config import ModelConfig
from servelab.model.loader import load_model
from servelab.model.transformer import rope_inv_freq
from servelab.testing.hf_reference import (
    HF_CLASSES,
    make_hf_exact_float64,
    randomise_norms_and_biases,
    reference_inv_freq,
)
from tests.helpers_model import PagedDriver

TOL = 1e-9
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small so that, with head_dim 8, all three llama3 branches are taken
    "original_max_position_embeddings": 64,
}


def build_hf_model(arch: str, tied: bool, rope_scaling: dict | None = None, seed: int = 0):
    config_cls, model_cls = HF_CLASSES[arch]
    kwargs = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )
    if arch != "qwen2":
        kwargs["head_dim"] = 8
    if rope_scaling is not None:
        kwargs["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    config = config_cls(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float64).eval()
    randomise_norms_and_biases(model)
    return model


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0]


CASES = [
    # arch, tied, sharded, rope_scaling
    ("qwen3", False, False, None),
    ("qwen3", True, True, None),
    ("qwen2", False, True, None),
    ("llama", True, False, None),
    ("llama", False, False, LLAMA3_SCALING),
]


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu_kernels"])
@pytest.mark.parametrize("arch,tied,sharded,rope_scaling", CASES)
def test_logits_match_transformers(tmp_path, arch, tied, sharded, rope_scaling, kernels):
    """Logits of prompts, chunks and decodes against transformers in float64,
    through torch's ops and through servelab's C++ CPU kernels
    (`servelab.executor.kernel_forward`)."""
    hf = build_hf_model(arch, tied, rope_scaling)
    hf.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded

    model, config, tokenizer = load_model(str(tmp_path), "float64", "cpu")
    forward = None
    if kernels:
        assert cpu_kernel_problems(model) == []
        forward = KernelForward(model)
    assert tokenizer is None
    assert (config.architecture, config.tie_word_embeddings) == (arch, tied)
    assert config.eos_token_ids == [2, 3] and config.bos_token_id == 1
    hf_head = dict(hf.named_parameters()).get("lm_head.weight")
    assert (model.lm_head is None) == tied
    if not tied:
        assert torch.equal(model.lm_head.weight, hf_head)

    make_hf_exact_float64(hf, reference_inv_freq(8, 10000.0, config.rope_scaling))
    gen = torch.Generator().manual_seed(1)
    prompts = {
        s: torch.randint(0, 96, (n,), generator=gen).tolist() for s, n in enumerate((7, 11, 3))
    }
    tokens = {s: list(p) for s, p in prompts.items()}
    driver = PagedDriver(model, num_blocks=32, block_size=4, forward=forward)

    def check(chunks):
        logits = driver.step(chunks)
        for (seq, new), got in zip(chunks, logits, strict=True):
            upto = driver.num_computed[seq]
            want = hf_logits(hf, tokens[seq][:upto])[upto - len(new) :]
            torch.testing.assert_close(got, want, rtol=0, atol=TOL)
        return logits

    # step 1: two whole prompts and the first chunk of a longer one
    check([(0, tokens[0]), (1, tokens[1][:6]), (2, tokens[2])])
    # then decodes first, the rest of the chunked prompt after them; then pure decodes
    for step in range(4):
        for seq in (0, 2) if step == 0 else (0, 1, 2):
            tokens[seq].append(int(torch.randint(0, 96, (1,), generator=gen)))
        chunks = [(0, tokens[0][-1:]), (2, tokens[2][-1:])]
        chunks += [(1, tokens[1][6:])] if step == 0 else [(1, tokens[1][-1:])]
        check(chunks)


def test_llama3_inv_freq_matches_transformers_and_reference():
    hf = build_hf_model("llama", False, LLAMA3_SCALING)
    config = ModelConfig.from_hf_dict(json.loads(hf.config.to_json_string()))
    ours = rope_inv_freq(config)
    reference = torch.tensor(reference_inv_freq(8, 10000.0, LLAMA3_SCALING), dtype=torch.float64)
    torch.testing.assert_close(ours, reference, rtol=1e-14, atol=0)
    # HF computes the same formula in float32
    hf_inv_freq = hf.model.rotary_emb.original_inv_freq.to(torch.float64)
    torch.testing.assert_close(ours, hf_inv_freq, rtol=1e-6, atol=0)
    # every branch of the formula is exercised: kept, blended and divided frequencies
    plain = torch.tensor(reference_inv_freq(8, 10000.0, None), dtype=torch.float64)
    ratio = (plain / ours).tolist()
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(8.0)
    assert any(1.0 + 1e-6 < r < 8.0 - 1e-6 for r in ratio)


def test_tied_model_has_no_lm_head_and_uses_embeddings(tmp_path):
    hf = build_hf_model("llama", tied=True)
    hf.save_pretrained(tmp_path)
    model, _, _ = load_model(str(tmp_path), "float64", "cpu")
    assert "lm_head.weight" not in dict(model.named_parameters())
    hidden = torch.randn(3, 32, dtype=torch.float64)
    expected = hidden @ model.model.embed_tokens.weight.T
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=0, atol=1e-12)


def test_kv_cache_shape_and_bytes():
    hf = build_hf_model("qwen3", tied=False)
    config = ModelConfig.from_hf_dict(json.loads(hf.config.to_json_string()))
    assert config.qk_norm and not config.attention_bias
    from servelab.model.transformer import Transformer

    model = Transformer(config, torch.float32)
    assert model.kv_cache_shape(10, 16) == (10, 16, 2, 8)
    # K and V, 2 layers, 2 kv heads, head_dim 8, 2 bytes
    assert config.kv_bytes_per_token("bfloat16") == 2 * 2 * 2 * 8 * 2
