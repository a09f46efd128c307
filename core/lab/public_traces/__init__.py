"""Readers of the workloads the field publishes, each in its published format:
ShareGPT conversations, BurstGPT and Azure LLM inference traces, Mooncake
traces. One module per format; what they share (selection, caps, provenance,
one-line errors) is in common.py. Each reader is a workload builder
(servelab.lab.workload.WORKLOADS) returning `TraceRequests`, whose `source`
the runner records in the run's provenance."""

from servelab.lab.public_traces.azure import azure_llm_workload
from servelab.lab.public_traces.burstgpt import burstgpt_workload
from servelab.lab.public_traces.common import TraceRequests
from servelab.lab.public_traces.mooncake import mooncake_workload
from servelab.lab.public_traces.sharegpt import sharegpt_workload

PUBLIC_TRACES = {
    "sharegpt": sharegpt_workload,
    "burstgpt": burstgpt_workload,
    "azure_llm": azure_llm_workload,
    "mooncake": mooncake_workload,
}


def trace_source(requests: list) -> dict:
    """The provenance entry of a replayed public trace, `{}` for any other workload."""
    return {"workload_trace": requests.source} if isinstance(requests, TraceRequests) else {}


__all__ = ["PUBLIC_TRACES", "TraceRequests", "trace_source"]
