"""`simulated`: speculative decoding's drafts for `executor=simulated`, right at
configured rates, so a speculative sweep runs at any model's scale without a model.

The simulated executor samples stand-in tokens (`servelab.executor.stand_in`): a
hash of the request, its sample index and the output position. This proposer
drafts those very tokens, each right with a per-position probability and a wrong
token otherwise: `acceptance[i]` is P(draft i right | drafts before it right), the
conditional rate a draft model's acceptance is usually quoted in (later positions
fall: [0.8, 0.6, 0.45, 0.3]). A position past the list takes its last rate. The
rates may instead come from a recorded run (`acceptance_trace`: its `steps.csv`,
its `results.json` or its folder): its share of verifications that kept draft i,
divided by the share that kept draft i - 1 (verifications that offered fewer
drafts, at a request's end or under adaptive k, lower the later shares a little).

Every choice is a hash of (`seed`, the sample, the output position, the draft's
position): the same config drafts the same tokens in every run, whatever the
batch. `draft_model` (optional) names the model whose forwards the drafts stand
for; the simulated executor adds their time to each step (`Proposer.draft_model`).

It knows a sequence's stand-in key from its request id and sample index; a
`DraftRequest` carries no sample index, so it finds it from the sequence's first
and latest outputs (sample 0 first: every request with n = 1). With any other
executor its drafts would never match: at engine start it learns the executor
(its `servelab_engine_ready` hook), and against one that does not sample
stand-ins every proposal raises a ConfigError naming it, which the core logs once
and counts (`spec_proposer_errors`) while requests decode without drafts.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.proposer import DraftRequest, Proposer
from servelab.errors import ConfigError
from servelab.executor.stand_in import GOLDEN, MASK64, mix, output_token, sequence_key

MAX_SAMPLES = 256  # sample indexes tried when finding a sequence's key (n of a request)
UNIT = float(1 << 64)


class SimulatedProposer(Proposer):
    description = (
        "drafts the simulated executor's stand-in tokens, right at per-position rates "
        "(executor=simulated only)"
    )

    def __init__(
        self,
        acceptance: Any = (0.8, 0.6, 0.45, 0.3),
        acceptance_trace: str | None = None,
        draft_model: Any = None,
        seed: int = 0,
        **common,
    ) -> None:
        super().__init__(**common)
        rates = read_trace(acceptance_trace) if acceptance_trace else check_rates(acceptance)
        self.rates = [rates[min(i, len(rates) - 1)] for i in range(self.k)]
        self.seed = mix(seed & MASK64)
        self._draft_model = draft_model
        if draft_model is not None:
            check_draft_model(draft_model, self.vocab_size)
        self.eos: frozenset[int] = frozenset()  # the target's, once bound to the executor
        self.refusal: str | None = None  # set when bound to an executor without stand-ins
        self.keys: dict[int, int | None] = {}  # seq_id -> its stand-in key (None: none fits)

    def bind(self, executor: Any) -> None:
        """At engine start: the target's EOS ids (stand-ins avoid them), or a refusal
        when `executor` samples real tokens."""
        if getattr(executor, "samples_stand_ins", False):
            self.eos = frozenset(executor.model_config.eos_token_ids or ())
            self.refusal = None
            return
        name = getattr(executor, "name", type(executor).__name__)
        self.refusal = (
            f"proposer=simulated drafts the stand-in tokens of executor=simulated; "
            f"executor={name} samples a model's own tokens, which it cannot know, so every "
            "draft would be rejected: run it with executor=simulated, or use a proposer "
            "for real models (ngram)"
        )

    def draft_model(self) -> Any:
        return self._draft_model

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        if self.refusal is not None:
            raise ConfigError(self.refusal)
        return [self.draft(r) for r in requests]

    def draft(self, request: DraftRequest) -> list[int]:
        """Up to `max_drafts` drafts: the stand-in token at each position while the
        hashed draws stay under the rates, a wrong token from the first miss on."""
        outputs = len(request.token_ids) - request.num_prompt_tokens
        key = self.key_of(request, outputs)
        if key is None:
            return []
        vocab, eos = self.vocab_size, self.eos
        base = mix(self.seed ^ key ^ ((outputs * GOLDEN) & MASK64))  # one per verification
        drafts, right = [], True
        for i in range(request.max_drafts):
            target = output_token(key, outputs + i, vocab, eos)
            draw = mix((base + (i + 1) * GOLDEN) & MASK64)
            right = right and draw / UNIT < self.rates[i]
            if right or vocab < 2:
                drafts.append(target)
            else:  # any other token: the draw's bits past the comparison pick which
                drafts.append((target + 1 + (draw >> 11) % (vocab - 1)) % vocab)
        return drafts

    def key_of(self, request: DraftRequest, outputs: int) -> int | None:
        """The sequence's stand-in key: the sample index whose stand-ins are its first
        and latest outputs (None: its outputs are not stand-ins)."""
        seq_id = request.seq_id
        if seq_id in self.keys:
            return self.keys[seq_id]
        key = None
        if outputs > 0:
            tokens, vocab, eos = request.token_ids, self.vocab_size, self.eos
            first, last = tokens[request.num_prompt_tokens], tokens[-1]
            for index in range(MAX_SAMPLES):
                candidate = sequence_key(request.request_id, index)
                if output_token(candidate, 0, vocab, eos) == first and (
                    output_token(candidate, outputs - 1, vocab, eos) == last
                ):
                    key = candidate
                    break
            self.keys[seq_id] = key
        return key

    def on_finish(self, seq_id: int) -> None:
        self.keys.pop(seq_id, None)


def check_rates(acceptance: Any) -> list[float]:
    """`acceptance` as a list of rates in [0, 1] (one number: every position's)."""
    values = [acceptance] if isinstance(acceptance, (int, float)) else acceptance
    try:
        rates = [float(v) for v in values if not isinstance(v, bool)]
    except (TypeError, ValueError):
        rates = []
    if not rates or len(rates) != len(values) or not all(0.0 <= r <= 1.0 for r in rates):
        raise ConfigError(
            "proposer 'simulated' option acceptance must be a rate in [0, 1] or a list of "
            f"them (P(draft i right | the drafts before it right)), got {acceptance!r}"
        )
    return rates


def read_trace(path: str) -> list[float]:
    """The conditional per-position acceptance of a recorded run: its `steps.csv`
    (per-step counts `spec_num_drafts`, `spec_accepted_pos_<i>`), a CSV of one row
    or a `results.json` with the summary's `spec_accepted_pct_pos<i>`, or its folder."""
    source = Path(path)
    if source.is_dir():
        found = [source / n for n in ("steps.csv", "results.json") if (source / n).is_file()]
        if not found:
            raise ConfigError(f"acceptance_trace {path!r} holds neither steps.csv nor results.json")
        source = found[0]
    if not source.is_file():
        raise ConfigError(f"acceptance_trace {path!r} is no file or run folder")
    if source.suffix == ".json":
        data = json.loads(source.read_text())
        summary = data.get("summary", data) if isinstance(data, Mapping) else {}
        shares = _positions(summary, "spec_accepted_pct_pos", 100.0)
    else:
        with open(source, newline="") as handle:
            rows = list(csv.DictReader(handle))
        if rows and "spec_num_drafts" in rows[0]:  # a run's steps.csv: sum the counts
            drafts = sum(float(r["spec_num_drafts"] or 0) for r in rows)
            totals = {
                k: sum(float(r[k] or 0) for r in rows)
                for k in rows[0]
                if k.startswith("spec_accepted_pos_")
            }
            shares = _positions(totals, "spec_accepted_pos_", drafts) if drafts else []
        else:
            shares = _positions(rows[0], "spec_accepted_pct_pos", 100.0) if len(rows) == 1 else []
    if not shares:
        raise ConfigError(
            f"acceptance_trace {path!r} holds no acceptance by position (steps.csv's "
            "spec_accepted_pos_<i>, or a summary's spec_accepted_pct_pos<i>): record it from "
            "a run with a proposer"
        )
    # P(kept i) / P(kept i - 1): the rate of draft i given the drafts before it kept
    rates, before = [], 1.0
    for share in shares:
        rates.append(min(1.0, share / before) if before > 0 else 0.0)
        before = share
    return rates


def _positions(figures: Mapping, prefix: str, scale: float) -> list[float]:
    """The figures `<prefix><i>`, in position order, each divided by `scale`."""
    found = {}
    for key, value in figures.items():
        if key.startswith(prefix) and key[len(prefix) :].isdigit():
            found[int(key[len(prefix) :])] = float(value) / scale
    return [found[i] for i in range(len(found)) if i in found]


def check_draft_model(node: Any, vocab_size: int) -> None:
    """A ConfigError unless `node` names a model shape sharing the target's vocabulary."""
    from servelab.model.loader import load_shape, model_source

    shape = load_shape(model_source(node))
    if vocab_size and shape.vocab_size != vocab_size:
        raise ConfigError(
            f"proposer 'simulated' draft_model {model_source(node)!r} has a vocabulary of "
            f"{shape.vocab_size} tokens and the target {vocab_size}: a draft model shares its "
            "target's tokenizer"
        )


@hookimpl
def servelab_register_proposers():
    return {"simulated": SimulatedProposer}


@hookimpl
def servelab_engine_ready(engine: Any) -> None:
    """Binds the engine's `simulated` proposer to its executor (see the module docstring)."""
    speculation = getattr(engine.scheduler, "speculation", None)
    proposer = getattr(speculation, "proposer", None)
    if isinstance(proposer, SimulatedProposer):
        proposer.bind(engine.executor)
