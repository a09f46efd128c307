"""Engine behaviour beyond the oracle: batch invariance, seeded sampling,
bad input (each a clear error that leaves the engine and other requests
intact) and build-time configuration errors."""

from __future__ import annotations

import json

import pytest

from servelab import LLM, ConfigError, RequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5 + i for i in range(n)] for n in (1, 3, 7, 12, 20, 31, 2, 9)]


def tiny(**kwargs) -> LLM:
    options = dict(model="tiny", dtype="float64", max_model_len=128)
    options.update(kwargs)
    return LLM(**options)


def test_outputs_do_not_depend_on_batch_composition():
    runs = [tiny(max_num_seqs=n).generate(PROMPTS, GREEDY) for n in (1, 3, 64)]
    tokens = [[o.token_ids for o in run] for run in runs]
    assert tokens[0] == tokens[1] == tokens[2]
    assert all(len(t) == 12 for t in tokens[0])


def test_seeded_request_gives_same_tokens_in_any_batch():
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    alone = tiny().generate([PROMPTS[3]], sampled)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 4
    mixed = tiny(max_num_seqs=3).generate(PROMPTS[:3] + [PROMPTS[3]], others[:3] + [sampled])
    assert mixed[3].token_ids == alone
    # a different seed changes the draw (the seed really is used)
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=8, ignore_eos=True)
    assert tiny().generate([PROMPTS[3]], other_seed)[0].token_ids != alone


def test_top_k_one_equals_greedy():
    llm = tiny()
    greedy = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    top1 = SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, top1)] == greedy


def test_finish_reasons_and_outputs():
    llm = tiny()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[
        0
    ]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    stop = out.token_ids[2]
    first = out.token_ids.index(stop)
    out2 = llm.generate(
        [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[stop])
    )
    assert out2[0].finish_reason == "stop" and out2[0].token_ids == out.token_ids[: first + 1]
    assert out.metrics["output_tokens"] == 4 and out.metrics["ttft"] is not None


# -- bad requests: a clear error, the rest of the batch completes, nothing leaks
# (bad SamplingParams fields: tests/engine/test_bad_input.py)
BAD_REQUESTS = [
    ([5] * 200, SamplingParams(max_tokens=4), ["200", "max_model_len=128"]),
    ([], SamplingParams(max_tokens=4), ["empty"]),
    ([3, 9999], SamplingParams(max_tokens=4), ["9999", "vocabulary"]),
    ([3, -1], SamplingParams(max_tokens=4), ["-1", "vocabulary"]),
]


@pytest.mark.parametrize("prompt,params,words", BAD_REQUESTS)
def test_bad_request_is_rejected_and_others_complete(prompt, params, words):
    llm = tiny()
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([PROMPTS[2], prompt, PROMPTS[4]], [good, params, good])
    assert outs[1].error is not None and outs[1].finish_reason == "rejected"
    assert "gen-" in outs[1].error  # names the request
    for word in words:
        assert word in outs[1].error
    assert [len(o.token_ids) for o in (outs[0], outs[2])] == [5, 5]
    assert outs[0].token_ids == tiny().generate([PROMPTS[2]], good)[0].token_ids
    eng = llm.engine
    eng.allocator.check_integrity()
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks


def test_add_request_raises_and_engine_keeps_running():
    eng = tiny().engine
    eng.add_request(PROMPTS[1], GREEDY, request_id="ok")
    with pytest.raises(RequestError, match=r"'long'.*200 tokens.*max_model_len=128"):
        eng.add_request([7] * 200, GREEDY, request_id="long")
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request(PROMPTS[1], GREEDY, request_id="ok")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["ok"] and len(outs[0].token_ids) == 12


# -- configuration errors, raised when the engine is built
def test_unknown_component_lists_registered_names():
    with pytest.raises(ConfigError, match=r"unknown scheduler 'fifo'.*continuous.*static"):
        tiny(scheduler="fifo")


def test_unknown_option_lists_accepted_options():
    with pytest.raises(ConfigError, match=r"blocksize.*accepted.*block_size.*prefix_caching"):
        tiny(allocator={"name": "paged", "blocksize": 8})
    with pytest.raises(ConfigError, match=r"max_seqs.*accepted.*max_num_seqs"):
        tiny(max_seqs=3)


def test_backend_that_cannot_serve_allocator_names_both():
    with pytest.raises(ConfigError) as err:
        tiny(attention={"name": "flash_varlen", "impl": "flash_attn"}, allocator="paged")
    message = str(err.value)
    assert "flash_varlen" in message and "paged" in message


def test_kv_budget_too_small_gives_the_numbers():
    with pytest.raises(ConfigError, match=r"holds 64 tokens.*max_model_len=128"):
        tiny(kv_cache_memory=64 * 1024, max_model_len=128)  # float64 tiny: 1 KiB per token


def test_bad_engine_values():
    with pytest.raises(ConfigError, match="dtype"):
        tiny(dtype="float8")
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        tiny(kv_cache_memory="lots")
    with pytest.raises(ConfigError, match="admission"):
        tiny(scheduler={"name": "continuous", "admission": "greedy"})


def test_text_prompts_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    words = ["hello", "world", "servelab", "runs", "tokens", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i + 4 for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    config = Qwen3Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
    )
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3"
    llm = LLM(model=str(tmp_path), dtype="float64", max_model_len=64)
    out = llm.generate(
        "hello world", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )[0]
    assert out.prompt_token_ids == [4, 5]
    assert len(out.token_ids) == 3 and isinstance(out.text, str)
