"""`eagle`: an EAGLE-style head drafts from the target's own features (EAGLE-1,
Li et al. 2024). The head is one decoder layer over the target's final hidden
state (after its final norm: what its LM head reads) and the next token's
embedding; its output goes through the target's LM head. For head position t
of a sequence x_0 .. x_n:

    input_t = fc(concat(embed(x_{t+1}), f_t))   # f_t: the target's feature at position t
    h_{t+1} = layer(input_t)                     # RoPE at position t + 1, causal over
                                                 # the head's positions before it
    draft   = argmax(lm_head(h_{t+1}))           # a guess of x_{t+2}

Each step the head first catches up over the positions whose true features the
target computed since (`on_hidden_states`), which gives the first draft; then
it drafts on from its own predicted features, k - 1 more times. The positions
computed from predicted features are dropped next step and computed again from
the true ones. Every request drafts together: each of these k passes runs the
head's matrix products once over all the requests' rows (as a decode step runs
the target's), and only attention, over each request's own K/V, goes request by
request. The head keeps its one layer's K/V per sequence, from the first
position it saw a feature for (a prefix the target's cache served has none: the
head then attends over what it saw).

The folder: `config.json` (`"architectures": ["ServelabEagleHead"]`, the layer's
shape, `"target"`: the target's folder, relative) and `model.safetensors`
(`fc.weight` [hidden, 2 hidden] and `layer.<a Qwen3 decoder layer's tensors>`);
the embeddings and LM head are read from the target's folder.
`benchmarks/spec_pair.py` trains one.
"""

from __future__ import annotations

import json
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.proposer import DraftRequest, Proposer
from servelab.errors import ConfigError
from servelab.model.loader import checkpoint_files

ARCHITECTURE = "ServelabEagleHead"


class HeadState:
    """One sequence's head: its layer's K/V [positions, kv heads, head dim] from
    position `first` on (`committed` of them from true features), and the true
    features not consumed yet (from position `pending_from`)."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.committed = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.pending_from = first
        self.pending: list[torch.Tensor] = []

    @property
    def next_position(self) -> int:
        """The head position whose true feature it needs next."""
        return self.first + self.committed


class EagleProposer(Proposer):
    description = "an EAGLE-style head over the target's features drafts"
    needs_hidden_states = True

    def __init__(self, model: Any = None, **common) -> None:
        super().__init__(**common)
        if model is None:
            raise ConfigError("proposer=eagle needs its head: proposer.model=PATH (a folder "
                              "with config.json and model.safetensors)")  # fmt: skip
        folder = Path(str(model))
        config = _read_config(folder)
        self.device = torch.device(str(self.engine_options.get("device", "cpu")))
        self.dtype = torch.float32
        self.weights = _read_tensors(folder / "model.safetensors", self.device)
        target = (folder / config["target"]).resolve()
        embed = _target_embeddings(target, self.device)
        if embed.shape[0] != self.vocab_size:
            raise ConfigError(f"the EAGLE head's target {target} has {embed.shape[0]} token ids, "
                              f"the engine's model {self.vocab_size}")  # fmt: skip
        self.embed = embed
        self.lm_head = _target_lm_head(target, self.device, embed)
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config["num_key_value_heads"])
        self.head_dim = int(config["head_dim"])
        self.eps = float(config["rms_norm_eps"])
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        self.inv_freq = 1.0 / (float(config["rope_theta"]) ** half)
        self.states: dict[int, HeadState] = {}

    # -- the target's features
    def on_hidden_states(self, seq_id: int, first: int, states: Any) -> None:
        state = self.states.get(seq_id)
        if state is None or first < state.next_position or first != _pending_end(state):
            # new, computed again (a recompute), or a gap: the head starts over here
            state = self.states[seq_id] = HeadState(first)
        state.pending.append(states.detach().to(self.device, self.dtype))

    def on_finish(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    # -- drafting
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts: dict[int, list[int]] = {r.seq_id: [] for r in requests}
        rows = []  # (request, its state, its head positions, their next tokens, features)
        for request in requests:
            caught_up = self._catch_up(request)
            if caught_up is not None:
                rows.append((request, *caught_up))
        if not rows:
            return [[] for _ in requests]
        # pass 1: every request's new positions from true features; each one's last
        # output drafts its first token
        groups = [(state, positions) for _, state, positions, _, _ in rows]
        next_ids = torch.tensor([t for *_, ids, _ in rows for t in ids], device=self.device)
        features = torch.cat([f for *_, f in rows])
        hidden = self._layer(groups, self.embed[next_ids], features)
        # each request's last row: its positions are consecutive
        ends = torch.tensor([end - 1 for end in accumulate(len(p) for _, p in groups)],
                            device=self.device)  # fmt: skip
        feature = hidden[ends]
        for (request, state, positions, _, _), token in zip(
            rows, self._logits(feature).argmax(dim=-1).tolist()
        ):
            state.committed += len(positions)
            drafts[request.seq_id].append(token)
        # passes 2..k: one position more for each request still drafting, from its own
        # predicted feature (`feature` row i belongs to `active[i]`)
        active = [request for request, *_ in rows]
        states = {request.seq_id: state for request, state, *_ in rows}
        for i in range(1, max(r.max_drafts for r in active)):
            keep = [at for at, r in enumerate(active) if r.max_drafts > i]
            if len(keep) < len(active):
                active = [active[at] for at in keep]
                feature = feature[torch.tensor(keep, device=self.device)]
            groups = [(states[r.seq_id], [len(r.token_ids) - 2 + i]) for r in active]
            ids = torch.tensor([drafts[r.seq_id][-1] for r in active], device=self.device)
            feature = self._layer(groups, self.embed[ids], feature)
            for request, token in zip(active, self._logits(feature).argmax(dim=-1).tolist()):
                drafts[request.seq_id].append(token)
        return [drafts[r.seq_id] for r in requests]

    def _catch_up(self, request: DraftRequest) -> tuple | None:
        """(state, head positions, the tokens after them, their true features) of the
        positions `request`'s head computes now, or None when it cannot draft."""
        state = self.states.get(request.seq_id)
        tokens = request.token_ids
        # the head catches up to the last computed position, n - 2 (n tokens; the last
        # one has no feature yet), whose output drafts x_n
        last = len(tokens) - 2
        if state is None or not state.pending or _pending_end(state) != last + 1:
            return None
        features = torch.cat(state.pending)
        start = state.pending_from
        state.pending, state.pending_from = [], last + 1
        self._truncate(state)  # drop the positions computed from predicted features
        positions = list(range(start, last + 1))
        return state, positions, [tokens[p + 1] for p in positions], features

    def _truncate(self, state: HeadState) -> None:
        if state.keys is not None:
            state.keys = state.keys[: state.committed]
            state.values = state.values[: state.committed]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)

    def _layer(
        self, groups: list[tuple[HeadState, list[int]]], embeds: torch.Tensor,
        features: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The head's layer over new head positions of several sequences, each
        `(its state, its positions)` with its rows consecutive in `embeds` and
        `features` (appending their K/V to its state): the predicted features
        [rows, hidden]. The products run over all rows at once; attention per sequence."""
        w = self.weights
        x = F.linear(torch.cat((embeds, features), dim=-1), w["fc.weight"])
        h = _rms_norm(x, w["layer.input_layernorm.weight"], self.eps)
        count = x.shape[0]
        q = F.linear(h, w["layer.self_attn.q_proj.weight"]).view(count, self.num_heads, -1)
        k = F.linear(h, w["layer.self_attn.k_proj.weight"]).view(count, self.num_kv_heads, -1)
        v = F.linear(h, w["layer.self_attn.v_proj.weight"]).view(count, self.num_kv_heads, -1)
        q = _rms_norm(q, w["layer.self_attn.q_norm.weight"], self.eps)
        k = _rms_norm(k, w["layer.self_attn.k_norm.weight"], self.eps)
        cos, sin = self._rope([p + 1 for _, positions in groups for p in positions])
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        outs, at = [], 0
        for state, positions in groups:
            rows = slice(at, at + len(positions))
            outs.append(self._attend(state, q[rows], k[rows], v[rows]))
            at = rows.stop
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        x = x + F.linear(out.reshape(count, -1), w["layer.self_attn.o_proj.weight"])
        h = _rms_norm(x, w["layer.post_attention_layernorm.weight"], self.eps)
        gate = F.linear(h, w["layer.mlp.gate_proj.weight"])
        up = F.linear(h, w["layer.mlp.up_proj.weight"])
        return x + F.linear(F.silu(gate) * up, w["layer.mlp.down_proj.weight"])

    def _attend(self, state: HeadState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> torch.Tensor:  # fmt: skip
        """One sequence's new positions: their K/V appended to its state, their
        queries [count, heads, dim] attending causally over all of it."""
        if state.keys is None:
            state.keys, state.values = k, v
        else:
            state.keys = torch.cat((state.keys, k))
            state.values = torch.cat((state.values, v))
        group = self.num_heads // self.num_kv_heads
        keys = state.keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, keys, dim]
        values = state.values.repeat_interleave(group, dim=1).transpose(0, 1)
        count = q.shape[0]
        past = keys.shape[1] - count
        mask = torch.ones(count, keys.shape[1], dtype=torch.bool, device=self.device).tril(past)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        return out.transpose(0, 1)

    def _rope(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.tensor(positions, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [count, 1, head dim]
        return angles.cos().to(self.device, self.dtype), angles.sin().to(self.device, self.dtype)


def _pending_end(state: HeadState) -> int:
    return state.pending_from + sum(len(p) for p in state.pending)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"proposer=eagle: cannot read {path} ({err})") from None
    if ARCHITECTURE not in config.get("architectures", []):
        raise ConfigError(f"{path} is not an EAGLE head (architectures must list "
                          f"{ARCHITECTURE!r})")  # fmt: skip
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                           "head_dim", "rms_norm_eps", "rope_theta", "target") if k not in config]  # fmt: skip
    if missing:
        raise ConfigError(f"{path} lacks {missing}")
    return config


def _read_tensors(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k).to(device, torch.float32) for k in f.keys()}


def _target_tensor(folder: Path, name: str, device: torch.device) -> torch.Tensor | None:
    for file, names in checkpoint_files(folder).items():
        if name in names:
            with safe_open(str(file), "pt") as f:
                return f.get_tensor(name).to(device, torch.float32)
    return None


def _target_embeddings(folder: Path, device: torch.device) -> torch.Tensor:
    embed = _target_tensor(folder, "model.embed_tokens.weight", device)
    if embed is None:
        raise ConfigError(f"the EAGLE head's target {folder} has no model.embed_tokens.weight")
    return embed


def _target_lm_head(folder: Path, device: torch.device, embed: torch.Tensor) -> torch.Tensor:
    head = _target_tensor(folder, "lm_head.weight", device)
    return embed if head is None else head  # tied embeddings


@hookimpl
def servelab_register_proposers():
    return {"eagle": EagleProposer}
