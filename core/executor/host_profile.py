"""Host profiles: the engine's own CPU time per step, beside the device's.

A step of a serving engine is device work (the forward, the LM head, the sampler's
kernels) and host work around it: scheduling, building the step's inputs and
metadata, reading the sampled tokens back into the sequences, stop checks, the
finished requests' detokenizing and records. The simulated executor prices the
device work from a hardware profile and the host work from a host profile, a sum
of figures times what the step holds (`HostProfile.seconds`):

    step_s + seq_s x rows                          every step
    + mixed_step_s + mixed_seq_s x decode rows     a step with prompt chunks,
      + chunk_s x chunks + key_s x their keys      which costs more per decode row
    + token_s x tokens + request_s x requests finishing in the step

A host profile is one YAML file of `conf/host/` (or a path or a mapping);
`servelab-calibrate --host OUT.yaml` measures one on the machine it runs on from the
real engine's steps (`servelab.lab.host_time`). Without one, the hardware profile's
`step_overhead` and `seq_overhead` are the host work (`of_hardware`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.errors import ConfigError
from servelab.executor.hardware import conf_group_dir, conf_group_names, conf_node

# the figures, in the order of `counts`' columns
FIGURES = ("step_s", "seq_s", "mixed_step_s", "mixed_seq_s", "chunk_s", "key_s", "token_s",
           "request_s")  # fmt: skip


def counts(step: Any, finishing: int = 0) -> tuple[float, ...]:
    """What a step (a `StepShape`) holds, by FIGURES: the step, its rows; when it has
    prompt chunks, itself again, its decode rows, its chunks and their keys (cached
    and new); its tokens and the requests finishing in it."""
    rows, chunks = float(step.num_seqs), len(step.prefill_q)
    tokens, finishing_ = float(step.num_tokens), float(finishing)
    if not chunks:
        return (1.0, rows, 0.0, 0.0, 0.0, 0.0, tokens, finishing_)
    keys = float(step.prefill_start.sum() + step.prefill_q.sum())
    return (1.0, rows, 1.0, float(len(step.decode_keys)), float(chunks), keys, tokens,
            finishing_)  # fmt: skip


@dataclass(frozen=True)
class HostProfile:
    name: str
    step_s: float = 0.0  # seconds per step
    seq_s: float = 0.0  # per scheduled sequence (a row)
    mixed_step_s: float = 0.0  # more per step with prompt chunks
    mixed_seq_s: float = 0.0  # more per decode row of a step with prompt chunks
    chunk_s: float = 0.0  # more per prompt chunk
    key_s: float = 0.0  # per key (cached and new) of a prompt chunk
    token_s: float = 0.0  # per computed token (prompt chunks' and decodes')
    request_s: float = 0.0  # per request finishing in the step (its output, its records)
    sources: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_hardware(cls, profile: Any) -> HostProfile:
        """The host work a hardware profile states (`step_overhead`, `seq_overhead`)."""
        return cls(f"{profile.name}'s step_overhead and seq_overhead",
                   step_s=profile.step_overhead, seq_s=profile.seq_overhead)  # fmt: skip

    @property
    def counts_finishing(self) -> bool:
        """Whether `seconds` reads the requests finishing in a step."""
        return bool(self.request_s)

    def seconds(self, step: Any, finishing: int = 0) -> float:
        """A step's host seconds (`step`: a `StepShape`)."""
        seconds = self.step_s + self.seq_s * step.num_seqs
        # the other terms are added only when set, so a hardware profile's own figures
        # price a step to the same bit as before host profiles existed
        if self.token_s:
            seconds += self.token_s * step.num_tokens
        if self.request_s and finishing:
            seconds += self.request_s * finishing
        mixed = (self.mixed_step_s, self.mixed_seq_s, self.chunk_s, self.key_s)
        if len(step.prefill_q) and any(mixed):
            seconds += sum(f * c for f, c in zip(mixed, counts(step)[2:6]))
        return seconds

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def host_dir() -> Path:
    return conf_group_dir("host")


def host_names() -> list[str]:
    return conf_group_names("host")


def load_host(node: Any) -> HostProfile | None:
    """A host profile from a name, a YAML path or a mapping; None stays None."""
    if node is None or isinstance(node, HostProfile):
        return node
    node = conf_node(node, "host", "host profile", {f.name for f in dataclasses.fields(HostProfile)})
    if "name" not in node:
        raise ConfigError("a host profile lacks its name")
    values: dict[str, Any] = {"name": str(node["name"])}
    for key in FIGURES:
        value = node.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"host profile {key} must be seconds >= 0, got {value!r}")
        values[key] = float(value)
    values["sources"] = {str(k): str(v) for k, v in dict(node.get("sources") or {}).items()}
    return HostProfile(**values)
