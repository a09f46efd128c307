"""The token-exact oracle: tiny random Hugging Face checkpoints, transformers'
greedy `generate` per prompt (no padding) as the reference, and servelab runs
of any combination of parts compared against it.

transformers computes RMSNorm and RoPE in float32 even for a float64 model;
the reference patches those two modules to the same formulas in float64
(`make_hf_exact_float64`), so "float64" means float64 all the way and a
near-tie can never flip a token on rounding alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig

from servelab import LLM, SamplingParams
from servelab.plugin_manager import registered
from tests.test_model import HF_CLASSES, make_hf_exact_float64, reference_inv_freq

VOCAB = 128
MAX_MODEL_LEN = 64


def build_hf(arch: str, seed: int = 0, tied: bool = False):
    config_cls, model_cls = HF_CLASSES[arch]
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch != "qwen2":
        kwargs["head_dim"] = 16
    config = config_cls(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float64).eval()
    with torch.no_grad():  # HF starts norms at 1 and biases at 0: randomise them
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    make_hf_exact_float64(model, reference_inv_freq(16, theta, None))
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int, stop_ids: list[int] | None) -> list[int]:
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=stop_ids or None,
        pad_token_id=0,
    )
    out = model.generate(torch.tensor([prompt]), generation_config=gen)
    return out[0, len(prompt) :].tolist()


# -- the prompt set: mixed lengths, a shared long prefix, length 1, max_tokens 1
def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)

    def rand(n: int) -> list[int]:
        return torch.randint(4, VOCAB, (n,), generator=g).tolist()

    shared = rand(21)
    return [
        rand(1),
        rand(2),
        rand(5),
        rand(13),
        rand(30),
        shared + rand(3),
        shared + rand(9),
        shared,
        rand(17),
        shared[:16] + rand(6),
        rand(40),
        rand(8),
        rand(24),
    ]


PROMPTS = _prompts()
MAX_TOKENS = [6, 8, 1, 12, 5, 9, 7, 10, 4, 11, 6, 10, 3]


@dataclass
class OracleCase:
    """A saved checkpoint, the prompts' sampling parameters and transformers' outputs."""

    folder: Path
    prompts: list[list[int]]
    params: list[SamplingParams]
    expected: list[list[int]] = field(default_factory=list)
    eos: int = 2


def _first_new_token(run: list[int], after: int, avoid: set[int]) -> int | None:
    """A token the run reaches at step >= `after` that it did not produce before."""
    for i in range(after, len(run)):
        if run[i] not in run[:i] and run[i] not in avoid:
            return run[i]
    return None


def make_case(arch: str, folder: Path, seed: int = 0) -> OracleCase:
    """Saves a checkpoint whose EOS is a token some prompt really reaches mid-way,
    gives another prompt a stop token it hits mid-way, and records
    transformers' outputs for the final parameters."""
    model = build_hf(arch, seed)
    free_runs = [hf_greedy(model, p, m, None) for p, m in zip(PROMPTS, MAX_TOKENS)]
    eos = next(t for run in free_runs if (t := _first_new_token(run, 2, set())) is not None)
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(folder, safe_serialization=True)
    ignore_eos = [i % 4 == 1 for i in range(len(PROMPTS))]  # a few prompts run past EOS
    # a stop token that a prompt not stopped by EOS earlier reaches mid-way
    stop_at, stop = next(
        (i, t)
        for i, run in enumerate(free_runs)
        if eos not in run[:-1] and (t := _first_new_token(run, 2, {eos})) is not None
    )
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=m,
            stop_token_ids=[stop] if i == stop_at else [],
            ignore_eos=ignore_eos[i],
        )
        for i, m in enumerate(MAX_TOKENS)
    ]
    expected = []
    for prompt, p in zip(PROMPTS, params):
        stops = ([] if p.ignore_eos else [eos]) + p.stop_token_ids
        expected.append(hf_greedy(model, prompt, p.max_tokens, stops))
    assert any(out and out[-1] == eos for out in expected), "no prompt reaches EOS"
    assert expected[stop_at][-1] == stop and len(expected[stop_at]) < params[stop_at].max_tokens
    return OracleCase(folder, PROMPTS, params, expected, eos)


# -- combinations, enumerated from the registry
# Built-in parts are tried in the variants that matter; a part added by a
# plugin is tried with its default options, so it is covered automatically.
VARIANTS = {
    "scheduler": {
        "static": [{"admission": "reserve"}],
        "continuous": [{"admission": "on_demand"}],
        "chunked": [{"admission": "on_demand", "chunk_size": 8}],
    },
    "allocator": {
        "contiguous": [{}],
        "paged": [{"block_size": 4}, {"block_size": 4, "prefix_caching": True}],
    },
    "preemption": {},
    "attention": {"flash_varlen": [{"impl": "reference"}]},
}


def variants(kind: str) -> list[dict]:
    out = []
    for name in sorted(registered(kind)):
        for options in VARIANTS[kind].get(name, [{}]):
            out.append({"name": name, **options})
    return out


def combinations(kinds=("scheduler", "allocator", "preemption", "attention")) -> list[dict]:
    axes = [variants(k) for k in kinds]
    return [dict(zip(kinds, combo)) for combo in itertools.product(*axes)]


def combo_id(combo: dict) -> str:
    parts = []
    for node in combo.values():
        extra = "".join(f",{k}={v}" for k, v in node.items() if k not in ("name", "admission"))
        parts.append(node["name"] + extra)
    return "|".join(parts)


def run_engine(
    case: OracleCase, combo: dict, check_every_step: bool = True, **engine
) -> list[list[int]]:
    """Runs every prompt through one engine; checks allocator integrity after
    every step and that every block is free at the end."""
    options = dict(
        dtype="float64",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_MODEL_LEN,
        kv_cache_memory=160 * 1024,  # 160 tokens: tight enough to preempt
        swap_space=96 * 1024,
        max_num_seqs=8,
    )
    if combo.get("scheduler", {}).get("name") == "chunked":
        options["max_num_batched_tokens"] = 20
    options.update(engine)
    llm = LLM(model=str(case.folder), **combo, **options)
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(case.prompts, case.params)]
    outputs = {}
    while eng.has_unfinished():
        for out in eng.step():
            outputs[out.request_id] = out
        if check_every_step:
            eng.allocator.check_integrity()
    eng.allocator.check_integrity()
    usage = eng.allocator.usage()
    assert usage["blocks_free"] == usage["blocks_total"], "device blocks leaked"
    assert usage["host_blocks_free"] == usage["host_blocks_total"], "host blocks leaked"
    return [outputs[i].token_ids for i in ids]
