"""Training and held-out measurement of the trained pair, bounded by steps.

Why steps and not time: the same seed must give the same weights on a given
machine, so every run takes the same number of optimizer steps over the same
windows, however busy the machine is. Windows are random spans of the training
token stream, drawn from a generator seeded per model; AdamW with a linear
warm-up and a cosine decay to a tenth of the peak; float32 throughout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from spec_pair_models import EagleHead, Qwen3
from torch import nn

EAGLE_REGRESSION_WEIGHT = 1.0  # the EAGLE paper's weights: features first, tokens second
EAGLE_TOKEN_WEIGHT = 0.1

Log = Callable[[str], None]


@dataclass(frozen=True)
class TrainRun:
    steps: int
    batch_size: int
    seq_len: int  # tokens per window (the model sees seq_len, predicts seq_len - 1)
    lr: float
    warmup: int


def sample_windows(stream: torch.Tensor, run: TrainRun, generator: torch.Generator):
    """[batch, seq_len] spans of `stream`, starts uniform over the stream."""
    starts = torch.randint(0, len(stream) - run.seq_len, (run.batch_size,), generator=generator)
    return torch.stack([stream[s : s + run.seq_len] for s in starts.tolist()])


def learning_rate(run: TrainRun, step: int) -> float:
    if step < run.warmup:
        return run.lr * (step + 1) / run.warmup
    progress = (step - run.warmup) / max(1, run.steps - run.warmup)
    return run.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(module: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms)."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _run_steps(
    name: str,
    module: nn.Module,
    run: TrainRun,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    stream: torch.Tensor,
    seed: int,
    log: Log,
) -> float:
    """The optimizer loop shared by every model; returns the last logged mean loss."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = make_optimizer(module, run.lr)
    module.train()
    start, window_losses, mean_loss = time.perf_counter(), [], float("nan")
    every = max(1, run.steps // 10)
    for step in range(run.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(run, step)
        loss = loss_of(sample_windows(stream, run, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        window_losses.append(loss.item())
        if (step + 1) % every == 0 or step + 1 == run.steps:
            mean_loss = sum(window_losses) / len(window_losses)
            window_losses = []
            elapsed = time.perf_counter() - start
            log(f"{name}: step {step + 1}/{run.steps} loss {mean_loss:.3f} ({elapsed:.0f} s)")
    module.eval()
    return mean_loss


def lm_loss(model: Qwen3, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def train_lm(model: Qwen3, stream: torch.Tensor, run: TrainRun, seed: int, log: Log) -> float:
    """Next-token cross-entropy on random windows."""
    name = f"lm {model.shape.hidden_size}x{model.shape.num_layers}"
    return _run_steps(name, model, run, lambda w: lm_loss(model, w), stream, seed, log)


def eagle_inputs(target: Qwen3, windows: torch.Tensor):
    """(next_embeds, features, next_features, next_next_tokens) of windows [B, L]:
    head positions t = 0 .. L-3 get embed(x_{t+1}) and f_t, and learn f_{t+1}
    and x_{t+2}."""
    with torch.no_grad():
        features = target.features(windows)
        embeds = target.model.embed_tokens(windows)
    return embeds[:, 1:-1], features[:, :-2], features[:, 1:-1], windows[:, 2:]


def eagle_loss(head: EagleHead, target: Qwen3, windows: torch.Tensor) -> torch.Tensor:
    """Smooth L1 to the next feature plus the weighted cross-entropy of its tokens."""
    next_embeds, features, next_features, next_next = eagle_inputs(target, windows)
    predicted = head(next_embeds, features)
    regression = F.smooth_l1_loss(predicted, next_features)
    logits = target.lm_head(predicted)
    tokens = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), next_next.reshape(-1))
    return EAGLE_REGRESSION_WEIGHT * regression + EAGLE_TOKEN_WEIGHT * tokens


def train_eagle(
    head: EagleHead, target: Qwen3, stream: torch.Tensor, run: TrainRun, seed: int, log: Log
) -> float:
    """The head on the frozen target's features."""
    target.eval().requires_grad_(False)
    return _run_steps("eagle", head, run, lambda w: eagle_loss(head, target, w), stream, seed, log)


def heldout_windows(stream: torch.Tensor, seq_len: int, max_tokens: int) -> list[torch.Tensor]:
    """Consecutive non-overlapping windows from the start of the held-out stream."""
    count = min(len(stream), max_tokens) // seq_len
    return [stream[i * seq_len : (i + 1) * seq_len] for i in range(count)]


@torch.no_grad()
def perplexity(model: Qwen3, windows: list[torch.Tensor], batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) over the windows' predicted positions."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = torch.stack(windows[i : i + batch_size])
        logits = model(batch[:, :-1])
        total += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


@torch.no_grad()
def eagle_accuracy(
    head: EagleHead, target: Qwen3, windows: list[torch.Tensor], batch_size: int = 8
) -> dict[str, float]:
    """Teacher-forced, on held-out windows: the head's top-1 against the text's
    x_{t+2} and against the target's own greedy token there; the target's
    top-1 against the text at the same positions, for scale."""
    hits_text = hits_target = target_hits_text = count = 0
    for i in range(0, len(windows), batch_size):
        batch = torch.stack(windows[i : i + batch_size])
        next_embeds, features, next_features, next_next = eagle_inputs(target, batch)
        head_top1 = target.lm_head(head(next_embeds, features)).argmax(-1)
        target_top1 = target.lm_head(next_features).argmax(-1)
        hits_text += (head_top1 == next_next).sum().item()
        hits_target += (head_top1 == target_top1).sum().item()
        target_hits_text += (target_top1 == next_next).sum().item()
        count += next_next.numel()
    return {
        "eagle_top1_vs_text": hits_text / count,
        "eagle_top1_vs_target": hits_target / count,
        "target_top1_vs_text": target_hits_text / count,
    }
