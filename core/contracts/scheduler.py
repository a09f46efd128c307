"""The scheduler contract: decides each step's work. Built-ins subclass
`servelab.scheduling.SchedulerCore`, which keeps the queues and owns
correctness, and override only its policy hooks (`servelab.scheduling.policy`)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from servelab.step.plan import SampledTokens, StepPlan
    from servelab.step.sequence import Sequence, SequenceGroup


class Scheduler(abc.ABC):
    """Decides each step's work. See `servelab.scheduling.SchedulerCore`."""

    description: ClassVar[str] = ""

    @abc.abstractmethod
    def add(self, group: SequenceGroup) -> None: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> list[Sequence]: ...

    @abc.abstractmethod
    def schedule(self) -> StepPlan: ...

    @abc.abstractmethod
    def update(self, plan: StepPlan, sampled: SampledTokens, now: float) -> list[SequenceGroup]:
        """After the forward: `sampled` holds the step's tokens, in order, with
        their owners' seq ids (`SampledTokens`: what the executor returned)."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool: ...

    def stop(self, seq: Sequence) -> None:
        """Finishes `seq` (reason "stop") from outside a step: a stop string matched
        its text. Its blocks are freed; its group leaves through `abort` once done."""
        raise NotImplementedError(f"{type(self).__name__} does not support stop strings")
