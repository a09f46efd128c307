"""Per-request logits processing before temperature: logit_bias, min_tokens and the
repetition, frequency and presence penalties, with vLLM's meanings:

- `logit_bias`: the bias is added to its token's logit;
- `min_tokens`: while fewer output tokens exist, EOS (unless `ignore_eos`) and the stop
  token ids are masked to -inf;
- `repetition_penalty` p (transformers' and vLLM's rule): every token seen in the prompt
  or the output has its logit divided by p when positive, multiplied by p otherwise;
- `frequency_penalty` f and `presence_penalty` q (OpenAI's rule, output tokens only):
  logit -= f * count + q * (count > 0).

Each row depends on its own sequence's tokens only, so a request's tokens do not depend
on its batch. Rows without processing are untouched; greedy rows then take the argmax of
the processed logits.
"""

from __future__ import annotations

import torch

from servelab.step.sequence import SamplingParams


def process_logits(logits: torch.Tensor, params: list[SamplingParams], seqs: list) -> torch.Tensor:
    """A copy of `logits` [N, V] with each row's processing applied; `seqs[i]` is row i's
    sequence (its `token_ids`, `num_prompt_tokens`, `eos_token_ids`)."""
    out = logits.clone()
    vocab = logits.shape[-1]
    device = logits.device
    for row, (p, seq) in enumerate(zip(params, seqs, strict=True)):
        if not p.adjusts_logits:
            continue
        values = out[row]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=values.dtype, device=device)
            values.index_add_(0, ids, bias)
        outputs = seq.token_ids[seq.num_prompt_tokens :]
        if len(outputs) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
            banned = [t for t in banned if 0 <= t < vocab]
            if banned:
                values[torch.tensor(banned, device=device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=device)
            picked = values[seen]
            penalty = p.repetition_penalty
            values[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
        if (p.frequency_penalty or p.presence_penalty) and outputs:
            counts = torch.bincount(
                torch.tensor(outputs, dtype=torch.long, device=device), minlength=vocab
            ).to(values.dtype)
            values -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                values.dtype
            )
    return out
