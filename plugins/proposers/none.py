"""`none`: no speculative decoding. The core never asks it: every step is exactly
one of an engine without a proposer."""

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.proposer import DraftRequest, Proposer


class NoProposer(Proposer):
    description = "no speculative decoding (the default)"
    proposes = False

    def propose(self, requests: list[DraftRequest]) -> list[list[int] | None]:
        return [None] * len(requests)


@hookimpl
def servelab_register_proposers():
    return {"none": NoProposer}
