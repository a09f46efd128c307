"""`mlfq`: skip-join by first-step time, demotion after each quantum, a higher
queue's arrival preempting lower-queue work, promotion after a wait."""

from __future__ import annotations

import pytest

from servelab.errors import ConfigError

from .scheduler_runs import admission_order, engine, greedy, records, step_until

# quanta 2, 4, 8 output tokens; a prompt of 4 tokens costs one decode step
MLFQ = {"name": "mlfq", "num_queues": 3, "base_quantum": 2, "prompt_tokens_per_step": 4}
SHORT = [5, 6, 7, 8]


def test_skip_join_puts_a_request_in_the_first_queue_whose_quantum_covers_its_first_step():
    eng = engine(MLFQ, max_num_seqs=4)
    # first steps 1, 2.25, 5 and 15 decode steps against quanta 2, 4, 8
    for rid, length in [("p4", 4), ("p9", 9), ("p20", 20), ("p60", 60)]:
        eng.add_request(list(range(2, 2 + length)), greedy(1), request_id=rid)
    assert {r: eng.scheduler.policy.level[r] for r in ("p4", "p9", "p20", "p60")} == {
        "p4": 0,
        "p9": 1,
        "p20": 2,
        "p60": 2,  # the last queue takes whatever no quantum covers
    }


def test_demotion_after_each_quantum_of_output_tokens():
    eng = engine(MLFQ)
    eng.add_request(SHORT, greedy(12), request_id="long")
    levels = []
    for _ in range(12):
        eng.step()
        levels.append(eng.scheduler.policy.level.get("long"))
    # 1 token per step: queue 0 for 2 tokens, queue 1 for 4 more, then queue 2 (the last)
    assert levels[:11] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    assert levels[11] is None  # finished and forgotten


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_higher_queue_arrival_preempts_lower_queue_work(preemption):
    eng = engine(MLFQ, preemption=preemption)
    eng.add_request(SHORT, greedy(12), request_id="long")
    for _ in range(3):  # 3 tokens: demoted to queue 1 after the second
        eng.step()
    eng.add_request([9, 10, 11, 12], greedy(2), request_id="short")  # queue 0
    outputs = step_until(eng)
    rec = records(eng)
    assert rec["short"].first_scheduled_step == rec["long"].first_scheduled_step + 3
    assert rec["short"].finished_step == rec["short"].first_scheduled_step + 1
    assert rec["long"].preemptions == 1 and rec["long"].finished_step > rec["short"].finished_step
    kind = "swap" if preemption == "swap" else "recompute"
    assert eng.scheduler.num_preemptions[kind] == 1
    # the same tokens as first-come first-served, where the short request waits
    fcfs = engine({"name": "continuous"})
    fcfs.add_request(SHORT, greedy(12), request_id="long")
    fcfs.add_request([9, 10, 11, 12], greedy(2), request_id="short")
    fcfs_outputs = step_until(fcfs)
    assert admission_order(fcfs) == ["long", "short"]
    assert {k: v.token_ids for k, v in outputs.items()} == {
        k: v.token_ids for k, v in fcfs_outputs.items()
    }


def test_a_request_that_waited_starvation_steps_is_promoted_and_runs():
    eng = engine({**MLFQ, "starvation_steps": 3})
    eng.add_request(SHORT, greedy(10), request_id="first")  # queue 0, then 1 after 2 tokens
    eng.add_request(list(range(2, 22)), greedy(2), request_id="long_prompt")  # queue 2
    step_until(eng)
    rec = records(eng)
    # waiting since step 1, promoted at step 4 to queue 0, above "first" (queue 1)
    assert rec["long_prompt"].first_scheduled_step == rec["first"].first_scheduled_step + 3
    assert rec["first"].preemptions == 1
    never = engine({**MLFQ, "starvation_steps": None})
    never.add_request(SHORT, greedy(10), request_id="first")
    never.add_request(list(range(2, 22)), greedy(2), request_id="long_prompt")
    step_until(never)
    assert admission_order(never) == ["first", "long_prompt"]
    assert records(never)["first"].preemptions == 0


@pytest.mark.parametrize("option", ["num_queues", "base_quantum", "prompt_tokens_per_step"])
def test_bad_counts_are_config_errors(option):
    with pytest.raises(ConfigError, match=f"mlfq scheduler: {option} must be an integer >= 1"):
        engine({**MLFQ, option: 0})
