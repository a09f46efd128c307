"""Proposers for testing speculative decoding: they draft what the target will
really say, often enough that verification keeps long runs (to the end of a
request, past a stop token, over a block boundary), and wrong at random
positions, so every rejection point is exercised too.

`ReferenceProposer` drafts from known outputs: for a sequence whose prompt is
one of `prompts`, the continuation of `outputs[i]` after the tokens it has
produced, each draft replaced by a wrong token with probability `wrong`
(seeded); past the known output, or once the sequence left it, random tokens.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.proposer import Draft, DraftRequest, Proposer


class ReferenceProposer(Proposer):
    description = "drafts from known outputs, wrong at random positions (testing)"

    def __init__(
        self,
        prompts: Any = (),
        outputs: Any = (),
        wrong: float = 0.25,
        seed: int = 0,
        **common,
    ) -> None:
        super().__init__(**common)
        self.answers = {tuple(p): list(o) for p, o in zip(prompts, outputs)}
        self.wrong = wrong
        self.rng = random.Random(seed)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [self._draft(r) for r in requests]

    def _draft(self, request: DraftRequest) -> list[int]:
        tokens = request.token_ids
        answer = self.answers.get(tuple(tokens[: request.num_prompt_tokens]), [])
        produced = list(tokens[request.num_prompt_tokens :])
        ahead = answer[len(produced) :] if answer[: len(produced)] == produced else []
        count = self.rng.randint(1, request.max_drafts)
        drafts = []
        for i in range(count):
            right = ahead[i] if i < len(ahead) else None
            if right is None or self.rng.random() < self.wrong:
                drafts.append(self.rng.randrange(self.vocab_size))
            else:
                drafts.append(right)
        return drafts


class RepeatLastProposer(Proposer):
    """The smallest useful proposer: the last token, repeated (a tiny random
    model often repeats itself)."""

    description = "the last token, k times (testing)"

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [[r.last_token] * r.max_drafts for r in requests]


class FixedDistributionProposer(Proposer):
    """Drafts drawn from one fixed distribution q, returned with their probabilities
    (`Draft.probs`): `weights` maps token ids to their share of `mass`, the rest of
    the mass spread evenly over the vocabulary. Rejection sampling must keep the
    target's distribution whatever q is."""

    description = "drafts drawn from a fixed distribution, with their probabilities (testing)"

    def __init__(self, weights: Any = None, mass: float = 0.8, seed: int = 0,
                 **common) -> None:  # fmt: skip
        super().__init__(**common)
        import torch  # the testing proposers are imported by torch-free tests too

        weights = {int(t): float(w) for t, w in dict(weights or {}).items()}
        total = sum(weights.values())
        q = torch.full((self.vocab_size,), (1.0 - mass) / self.vocab_size, dtype=torch.float64)
        for token, weight in weights.items():
            q[token] += mass * weight / total
        self.q = q
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        import torch

        out = []
        for request in requests:
            count = request.max_drafts
            tokens = torch.multinomial(self.q, count, replacement=True, generator=self.generator)
            out.append(Draft(tokens.tolist(), self.q.expand(count, -1)))
        return out


class RecordingProposer(RepeatLastProposer):
    """`repeat_last` that records the target's hidden states it is handed:
    `features[(request_id, sample index)][position]`, the latest for each position."""

    description = "repeat_last, recording the target's hidden states (testing)"
    needs_hidden_states = True

    def __init__(self, **common) -> None:
        super().__init__(**common)
        self.features: dict[int, dict[int, Any]] = {}

    def on_hidden_states(self, seq_id: int, first: int, states: Any) -> None:
        found = self.features.setdefault(seq_id, {})
        for i, row in enumerate(states):
            found[first + i] = row.clone()


def write_random_eagle_head(target: Path, folder: Path, seed: int = 0) -> Path:
    """An EAGLE head folder (the `eagle` proposer's format) of random weights
    shaped for the checkpoint at `target`: its drafts are mostly wrong, but
    every step of the head runs."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    tensors = {
        "fc.weight": rand(hidden, 2 * hidden),
        "layer.input_layernorm.weight": 1 + rand(hidden),
        "layer.post_attention_layernorm.weight": 1 + rand(hidden),
        "layer.self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        "layer.self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        "layer.self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        "layer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "layer.self_attn.q_norm.weight": 1 + rand(head_dim),
        "layer.self_attn.k_norm.weight": 1 + rand(head_dim),
        "layer.mlp.gate_proj.weight": rand(inter, hidden),
        "layer.mlp.up_proj.weight": rand(inter, hidden),
        "layer.mlp.down_proj.weight": rand(hidden, inter),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    head_config = {
        "architectures": ["ServelabEagleHead"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": config.get("rope_theta", 10000.0),
        "target": os.path.relpath(target, folder),
    }
    (folder / "config.json").write_text(json.dumps(head_config, indent=2))
    return folder


class TestProposers:
    """A runtime plugin registering the testing proposers (`reference`,
    `repeat_last`, `recording`, `fixed_distribution`)."""

    @hookimpl
    def servelab_register_proposers(self):
        return {
            "reference": ReferenceProposer,
            "repeat_last": RepeatLastProposer,
            "recording": RecordingProposer,
            "fixed_distribution": FixedDistributionProposer,
        }
