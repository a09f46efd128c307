"""What a decode is (`servelab.step.plan`): a sequence computing one token past
its prompt and sampling the next. The plan's rows, the sequence's own flag and
the plan's counts (the steps' `decode_tokens`) agree on it, and a closed plan
lists its decodes first."""

from __future__ import annotations

from servelab.step.plan import StepPlan
from servelab.step.sequence import SamplingParams, Sequence


def seq_with(prompt: int, outputs: int, computed: int) -> Sequence:
    seq = Sequence("r", list(range(1, prompt + 1)), SamplingParams(max_tokens=8))
    seq.token_ids += [7] * outputs
    seq.num_computed_tokens = computed
    return seq


def test_a_decode_is_one_token_past_the_prompt_that_samples():
    rows = [
        (seq_with(3, 0, 2), 1),  # samples, but computes a prompt token
        (seq_with(3, 2, 3), 1),  # a recompute past the prompt: samples nothing
        (seq_with(3, 2, 4), 1),  # a decode: its last token, then a sample
        (seq_with(3, 0, 0), 3),  # a whole prompt
    ]
    plan = StepPlan()
    for seq, count in rows:
        plan.add(seq, count)
    # a table of 2-token blocks covering each sequence's tokens, numbered apart per sequence
    plan.close(
        lambda s: [100 * s.num_computed_tokens + i for i in range(s.num_tokens // 2 + 1)],
        block_size=2,
        max_model_len=64,
    )
    decode = rows[2][0]
    assert [s.is_decoding for s, _ in rows] == [False, False, True, False]
    assert plan.seqs[0] is decode and plan.num_decodes == 1  # decodes first
    assert plan.seqs[1:] == [rows[0][0], rows[1][0], rows[3][0]]  # the rest in planning order
    assert plan.starts.tolist() == [4, 2, 3, 0]
    assert plan.counts.tolist() == [1, 1, 1, 3]
    assert plan.samples.tolist() == [True, True, False, True]
    # sequences, decodes (= decode tokens: the other 5 of the 6 are prefill), sampling rows
    assert plan.step_counts() == (4, 1, 3)
    assert plan.num_tokens == 6
    assert plan.stop_at.tolist() == [3 + 8]  # the decode row's length limit
    assert plan.table_lens.tolist() == [3, 2, 3, 2]
    assert plan.tables.tolist() == [[400, 401, 402], [200, 201, 0], [300, 301, 302], [0, 1, 0]]
    # the decode row writes position 4 into its table's block 4 // 2, at offset 0: slot 804
    assert plan.decode_blocks.tolist() == [402] and plan.decode_offsets.tolist() == [0]
    assert plan.decode_slots.tolist() == [402 * 2]
