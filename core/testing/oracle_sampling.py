"""The oracle's cases for logits processing (`SamplingParams.repetition_penalty`,
`frequency_penalty`, `presence_penalty`, `min_tokens`, `logit_bias`): greedy, so
the reference is exact, with transformers' own logits processors where it has one
(`RepetitionPenaltyLogitsProcessor`, `MinNewTokensLengthLogitsProcessor`,
`SequenceBiasLogitsProcessor`) and, for OpenAI's frequency and presence penalties
that transformers lacks, `CountPenaltyReference`: a plain loop over the generated
tokens, written from OpenAI's formula, sharing no code with the sampler.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from servelab.step.sequence import SamplingParams
from servelab.testing.hf_reference import build_tiny_hf
from servelab.testing.oracle import OracleCase, restored_num_threads

# the schedulers' whole-prompt and chunked paths, recompute and swap, prefix caching on
PATH_COMBOS = [
    {"scheduler": {"name": "continuous", "admission": "on_demand"},
     "allocator": {"name": "paged", "block_size": 4}, "preemption": {"name": "recompute"},
     "attention": {"name": "per_request"}},
    {"scheduler": {"name": "chunked", "admission": "on_demand", "chunk_size": 8},
     "allocator": {"name": "paged", "block_size": 4, "prefix_caching": True},
     "preemption": {"name": "swap"}, "attention": {"name": "per_request"}},
]  # fmt: skip

class CountPenaltyReference:
    """logit[t] -= frequency * count(t) + presence * (count(t) > 0), over generated tokens."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row in range(input_ids.shape[0]):
            counts = Counter(input_ids[row, self.prompt_len :].tolist())
            for token, count in counts.items():
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def processing_params(case: OracleCase) -> list[SamplingParams]:
    """Per prompt of `case`: its parameters plus one kind of processing (or several),
    strong enough to change the greedy tokens."""
    kinds = [
        dict(repetition_penalty=1.8),
        dict(repetition_penalty=0.6),
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(frequency_penalty=-1.0, presence_penalty=0.5),
        dict(min_tokens=None),  # filled: the max_tokens (EOS and stop tokens masked)
        dict(logit_bias={7: 4.0, 11: -50.0}),
        dict(repetition_penalty=1.3, frequency_penalty=0.7, logit_bias={9: 3.0}),
    ]
    out = []
    for i, p in enumerate(case.params):
        extra = dict(kinds[i % len(kinds)])
        if "min_tokens" in extra:
            extra["min_tokens"] = p.max_tokens
        out.append(dataclasses.replace(p, **extra))
    return out


def processing_case(case: OracleCase, arch: str = "qwen3", seed: int = 0) -> OracleCase:
    """`case` with `processing_params` and transformers' greedy outputs for them."""
    from transformers import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    with restored_num_threads(1):
        model = build_tiny_hf(arch, seed, num_kv_heads=2)
        model.config.eos_token_id = model.generation_config.eos_token_id = case.eos
        params = processing_params(case)
        expected = []
        for prompt, p in zip(case.prompts, params):
            stops = ([] if p.ignore_eos else [case.eos]) + p.stop_token_ids
            processors = []  # the sampler's order: bias, min_tokens, repetition, counts
            if p.logit_bias:
                processors.append(
                    SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()})
                )
            if p.min_tokens and stops:
                processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, stops))
            if p.repetition_penalty != 1.0:
                processors.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
            if p.frequency_penalty or p.presence_penalty:
                processors.append(
                    CountPenaltyReference(len(prompt), p.frequency_penalty, p.presence_penalty)
                )
            expected.append(_hf_processed(model, prompt, p.max_tokens, stops,
                                          LogitsProcessorList(processors)))  # fmt: skip
    return dataclasses.replace(case, params=params, expected=expected)


@torch.no_grad()
def _hf_processed(model, prompt, max_tokens, stops, processors) -> list[int]:
    import transformers

    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_tokens,
                                        eos_token_id=stops or None, pad_token_id=0)  # fmt: skip
    out = model.generate(torch.tensor([prompt]), generation_config=gen, logits_processor=processors)
    return out[0, len(prompt) :].tolist()
