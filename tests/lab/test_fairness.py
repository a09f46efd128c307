"""Per-client service figures (lab/fairness.py) on a hand-worked two-client run."""

import math

import numpy as np

from servelab.lab.fairness import contended_gap, fairness_figures, service_curves

STEPS = [{"step": i, "start_time": float(i), "kv_tokens_capacity": 10} for i in range(4)]


def _request(client, arrival, prompt, token_steps, finished_step, first_token_time):
    return {
        "client": client,
        "arrival_time": arrival,
        "prompt_tokens": prompt,
        "token_steps": str(token_steps),  # as requests.csv holds it
        "finished_step": finished_step,
        "first_token_time": first_token_time,
    }


# A: a 2-token prompt, tokens at steps 0, 1, 2; B: a 4-token prompt, its one token at step 3
REQUESTS = [_request("A", 0.0, 2, [0, 1, 2], 2, 0.5), _request("B", 0.0, 4, [3], 3, 3.25)]


def test_service_curves_weigh_prompt_at_first_token_and_each_output_token():
    clients, cumulative, backlog = service_curves(REQUESTS, STEPS, 1.0, 2.0)
    assert clients == ["A", "B"]
    # A: 2 (prompt) + 2 at step 0, then 2 per token; B: 4 + 2 at step 3
    assert cumulative.tolist() == [[4, 0], [6, 0], [8, 0], [8, 6]]
    assert backlog.tolist() == [[True, True]] * 3 + [[False, True]]


def test_gap_counts_only_while_both_are_backlogged():
    _, cumulative, backlog = service_curves(REQUESTS, STEPS, 1.0, 2.0)
    gap = contended_gap(cumulative, backlog)
    assert gap[:3].tolist() == [4, 6, 8] and math.isnan(gap[3])


def test_figures():
    out = fairness_figures(REQUESTS, STEPS, 1.0, 2.0)
    assert out["client_service_gap_max"] == 8
    assert out["client_service_bound"] == 2 * max(1.0 * 4, 2.0 * 10)
    assert out["client_gap_to_bound"] == 8 / 40
    assert out["service_share_pct_A"] == 100 and out["service_share_pct_B"] == 0
    assert out["arrival_share_pct_B"] == 50
    assert out["ttft_mean_ms_A"] == 500 and out["ttft_mean_ms_B"] == 3250


def test_a_late_arrival_is_backlogged_from_the_next_step_start():
    late = [_request("A", 0.0, 1, [0, 1, 2, 3], 3, 0.5), _request("B", 1.5, 1, [2], 2, 2.5)]
    _, _, backlog = service_curves(late, STEPS, 1.0, 2.0)
    assert backlog[:, 1].tolist() == [False, False, True, False]


def test_no_clients_no_figures():
    rows = [{**REQUESTS[0], "client": None}]
    assert fairness_figures(rows, STEPS) == {}
    assert np.isnan(contended_gap(np.zeros((1, 2)), np.zeros((1, 2), bool))).all()
