"""servelab's conformance kit on the sjf scheduler: the token-exact oracle
against transformers, integrity after every step, every request finishing
exactly once under preemption, aborts and parallel sampling."""

from __future__ import annotations

from servelab.testing import check_scheduler

from servelab_sjf import ShortestJobFirst


def test_sjf_with_default_options_conforms():
    report = check_scheduler(ShortestJobFirst)
    assert report.preempted > 0  # the kit's tight KV budget really preempted


def test_pure_sjf_on_total_work_conforms():
    check_scheduler(ShortestJobFirst, predictor="total", ageing=0.0)


def test_sjf_with_reserved_admission_conforms():
    check_scheduler(ShortestJobFirst, admission="reserve")
