"""Structured outputs through xgrammar: a request's constraint (`step.structured`)
checked and compiled once per (kind, spec) for the model's tokenizer, a matcher per
sequence advanced by its committed tokens, and one bitmask for every constrained
sampling row of a step, applied to the logits before the sampler reads them.

- `Grammars.check` builds the xgrammar `Grammar` (a JSON schema converted, a regex or
  an EBNF grammar parsed): milliseconds, and an invalid one is a RequestError naming
  the problem, before the request is queued. `Grammars.submit` compiles it against
  the vocabulary on a worker thread (the token masks of every grammar state: the slow
  part), cached by (kind, spec); the engine queues the request once it is done.
- A sequence's matcher is made on its first constrained row and fed its committed
  output tokens (`sync`): a forked sample, a request moved between instances and one
  recomputed after preemption catch up the same way, and the engine never has to
  tell the matcher what a step kept.
- A verify row j (speculative decoding) is masked for the state after the first j
  drafts: they are accepted, the row filled, and rolled back (xgrammar's rollback).
  After a draft the grammar refuses, the rows are left unmasked: the target's token at
  that draft is masked, so it differs from the draft and the later rows are dropped
  (rows after a drafted EOS likewise: the request ends at the EOS).
- JSON schemas are compiled without free whitespace (compact JSON): a model may
  otherwise write whitespace until `max_tokens` (a known failure of small models).
- The mask is applied with xgrammar's fused `apply_token_bitmask_inplace` on CUDA,
  and elsewhere (and for float64, which that kernel does not take) by a byte-to-bits
  table lookup and one masked fill in torch: the same -inf entries (`apply_bitmask`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from servelab.errors import RequestError
from servelab.step.structured import StructuredOutputs

COMPILE_THREADS = 2  # grammars compile on these; a slow one holds up only one of them
CACHE_ENTRIES = 256  # compiled grammars kept (least recently used dropped)
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: "


def _xgrammar():
    import xgrammar

    return xgrammar


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary: `tokenizer` a `tokenizers.Tokenizer` (as
    the loader gives) or a transformers tokenizer; `vocab_size` the model's (ids past
    the tokenizer's are never allowed); EOS the stop tokens a complete output takes."""
    xgr = _xgrammar()
    if not hasattr(tokenizer, "get_vocab") or hasattr(tokenizer, "to_str"):
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
    )


def build_grammar(constraint: StructuredOutputs):
    """The xgrammar `Grammar` of `constraint`; RequestError naming the problem."""
    xgr = _xgrammar()
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        if kind == "json_object":  # an object, as OpenAI's json_object means (not any value)
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c) for c in constraint.choice or ())
            )
        return xgr.Grammar.from_ebnf(spec)
    except Exception as err:  # xgrammar raises RuntimeError / ValueError with its reason
        reason = _XGR_PREFIX.sub("", str(err).strip().splitlines()[0] if str(err) else "")
        raise RequestError(f"structured_outputs.{kind} is invalid: {reason or err!r}") from None


@dataclass
class GrammarStats:
    """What compiling cost: counted since the engine started."""

    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    failures: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Grammars:
    """One model's grammar compiler: checks, compiles on worker threads, caches."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.stats = GrammarStats()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._compiling: dict[tuple[str, str], Future] = {}  # one compile per key at a time
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="servelab-grammar")
        # xgrammar's view of the vocabulary takes seconds for a 150,000-id one: made on a
        # worker thread too (the first compile waits for it), never on the engine's
        self._compiler = self._pool.submit(self._make_compiler, tokenizer, stop_token_ids)

    def _make_compiler(self, tokenizer: Any, stop_token_ids: list[int]):
        info = tokenizer_info(tokenizer, self.vocab_size, stop_token_ids)
        return _xgrammar().GrammarCompiler(info, cache_enabled=False)

    def check(self, constraint: StructuredOutputs) -> None:
        """Raises RequestError when `constraint`'s specification is invalid."""
        key = (constraint.kind, constraint.spec)
        with self.stats.lock:
            if key in self._cache:
                return
        build_grammar(constraint)

    def submit(self, constraint: StructuredOutputs) -> Future:
        """The compiled grammar of `constraint`, at once from the cache or later from a
        worker thread (its exception, when compiling fails)."""
        key = (constraint.kind, constraint.spec)
        with self.stats.lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                done: Future = Future()
                done.set_result(compiled)
                return done
            running = self._compiling.get(key)
            if running is not None and not running.done():  # the same grammar, compiling
                self.stats.cache_hits += 1
                return running
            future = self._compiling[key] = self._pool.submit(self._compile, key, constraint)
            return future

    def _compile(self, key: tuple[str, str], constraint: StructuredOutputs):
        try:
            compiler = self._compiler.result()
            start = time.perf_counter()  # the compile's own time, not the wait for the vocabulary
            compiled = compiler.compile_grammar(build_grammar(constraint))
        except Exception:
            with self.stats.lock:
                self.stats.failures += 1
                self._compiling.pop(key, None)
            raise
        with self.stats.lock:
            self._compiling.pop(key, None)
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - start
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled


class MatcherState:
    """A sequence's grammar matcher and how many of its output tokens it has taken."""

    def __init__(self, compiled: Any) -> None:
        self.matcher = _xgrammar().GrammarMatcher(compiled)
        self.consumed = 0

    def sync(self, seq) -> None:
        """Feeds the matcher the output tokens `seq` committed since the last call."""
        outputs = seq.token_ids[seq.num_prompt_tokens + self.consumed :]
        for token in outputs:
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"the grammar refuses output token {token}, which the "
                                   "mask should have ruled out")  # fmt: skip
            self.consumed += 1


def matcher_state(seq) -> MatcherState:
    """`seq`'s matcher state, made from its group's compiled grammar on first use."""
    state = seq.grammar_state
    if state is None:
        state = seq.grammar_state = MatcherState(seq.group.compiled_grammar)
    state.sync(seq)
    return state


def fill_row(bitmask: torch.Tensor, index: int, row_seq) -> None:
    """Row `index` of `bitmask`: the tokens `row_seq`'s grammar allows next. `row_seq`
    is a sequence, or a verify row's `DraftedHistory` (its sequence and the drafts
    before the row)."""
    seq = getattr(row_seq, "seq", row_seq)
    drafts = getattr(row_seq, "drafts", ())
    matcher = matcher_state(seq).matcher
    accepted = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        accepted += 1
    if accepted == len(drafts) and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(bitmask, index)
    else:  # after a refused draft, or after a drafted EOS: the row's token is never kept
        bitmask[index] = -1  # all bits set: every token allowed (see the module's note)
    if accepted:
        matcher.rollback(accepted)


# byte value -> its 8 bits, low bit first, as 8 bool bytes packed in one int64: True
# (1) where the token is NOT allowed; one gather per bitmask byte unpacks a row
_BANNED_BY_BYTE = (
    (~((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()).to(torch.uint8)
    .view(torch.int64).flatten()
)
_XGRAMMAR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def apply_grammar_masks(logits: torch.Tensor, seqs: list) -> int:
    """Masks, in place, the rows of `logits` [N, V] whose sequence is constrained: a
    token the grammar does not allow next gets -inf. `seqs[i]` is row i's sequence
    (or None). Returns how many rows were masked."""
    rows = [i for i, s in enumerate(seqs) if s is not None and _constrained(s)]
    if not rows:
        return 0
    # one row per logits row (xgrammar's kernel reads row i's mask at index i); only
    # the constrained rows are filled and applied
    bitmask = torch.empty(logits.shape[0], (logits.shape[-1] + 31) // 32, dtype=torch.int32)
    for row in rows:
        fill_row(bitmask, row, seqs[row])
    apply_bitmask(logits, bitmask, rows)
    return len(rows)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], kernel: str = "auto"
) -> None:
    """-inf, in place, where bit t of `bitmask[i]` is 0, in each row i in `rows` of
    `logits` (`bitmask` has a row per logits row; the others are not read).
    `kernel`: `xgrammar` (its fused kernel; float32 and 16-bit logits only), `table`
    (a byte-to-bits table lookup and one masked fill in torch; any dtype), or `auto`:
    xgrammar's on CUDA, the table elsewhere (on the CPU xgrammar's kernel runs on one
    thread: 46 ms against the table's 11 ms for 64 rows of Qwen3's 151,936 ids on
    2 cores of an AMD EPYC Zen 4). Both give the same logits."""
    device = logits.device
    bits = bitmask.to(device, non_blocking=True)
    if kernel == "auto":
        use_xgrammar = device.type == "cuda" and logits.dtype in _XGRAMMAR_DTYPES
        kernel = "xgrammar" if use_xgrammar else "table"
    if kernel == "xgrammar":
        everyone = len(rows) == logits.shape[0]
        _xgrammar().apply_token_bitmask_inplace(logits, bits, indices=None if everyone else rows)
        return
    vocab = logits.shape[-1]
    table = _BANNED_BY_BYTE.to(device)
    if len(rows) == logits.shape[0]:
        banned = table[bits.view(torch.uint8).long()].view(torch.bool)[:, :vocab]
        logits.masked_fill_(banned, float("-inf"))
        return
    index = torch.tensor(rows, device=device)
    banned = table[bits[index].view(torch.uint8).long()].view(torch.bool)[:, :vocab]
    logits[index] = logits[index].masked_fill(banned, float("-inf"))


def _constrained(row_seq) -> bool:
    seq = getattr(row_seq, "seq", row_seq)
    return seq.params.structured_outputs is not None
