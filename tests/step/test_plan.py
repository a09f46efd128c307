"""What a decode is (`servelab.step.plan`): a sequence computing one token past
its prompt and sampling the next. The item's flag, the sequence's own and the
plan's counts (the steps' `decode_tokens`) agree on it."""

from __future__ import annotations

from servelab.step.plan import ScheduledSeq, StepPlan
from servelab.step.sequence import SamplingParams, Sequence


def seq_with(prompt: int, outputs: int, computed: int) -> Sequence:
    seq = Sequence("r", list(range(1, prompt + 1)), SamplingParams(max_tokens=8))
    seq.token_ids += [7] * outputs
    seq.num_computed_tokens = computed
    return seq


def test_a_decode_is_one_token_past_the_prompt_that_samples():
    items = [
        ScheduledSeq(seq_with(3, 2, 4), 1),  # a decode: its last token, then a sample
        ScheduledSeq(seq_with(3, 0, 2), 1),  # samples, but computes a prompt token
        ScheduledSeq(seq_with(3, 2, 3), 1),  # a recompute past the prompt: samples nothing
        ScheduledSeq(seq_with(3, 0, 0), 3),  # a whole prompt
    ]
    assert [i.is_decode for i in items] == [True, False, False, False]
    assert [i.seq.is_decoding for i in items] == [True, False, False, False]
    plan = StepPlan(items)
    assert plan.num_decodes == 1
    # sequences, decodes (= decode tokens: the other 5 of the 6 are prefill), sampled
    assert plan.counts() == (4, 1, 3)
