"""The scheduler contract: decides each step's work. Built-ins subclass
`servelab.contracts.scheduler_base.BaseScheduler`, which keeps the queues."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from servelab.step.plan import StepPlan
    from servelab.step.sequence import Sequence, SequenceGroup


class Scheduler(abc.ABC):
    """Decides each step's work. See `servelab.contracts.scheduler_base.BaseScheduler`."""

    description: ClassVar[str] = ""

    @abc.abstractmethod
    def add(self, group: SequenceGroup) -> None: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> list[Sequence]: ...

    @abc.abstractmethod
    def schedule(self) -> StepPlan: ...

    @abc.abstractmethod
    def update(
        self, plan: StepPlan, sampled: Mapping[int, list[int]], now: float
    ) -> list[SequenceGroup]:
        """After the forward: `sampled` maps seq_id -> the tokens sampled for it
        (the engine passes a `SampledTokens`, which also lists them in order)."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool: ...
