"""servelab.lab.cluster: cluster experiments, run on a workload like the single-engine runner.

N engines behind a router on one virtual clock (`simulated`, `run`), prefill and decode
instances handing KV over a priced link (`disaggregated`, `handoff`, `run_disaggregated`),
a real prefill process and decode process (`pd_processes`), and the `servelab cluster=...`
jobs that save their results for servelab-report (`cli_run`, `pd_cli`). They use the
cluster's own parts (servelab.cluster: dispatcher, links, KV wire, the `cluster:` node) and
the harness's workloads, arrivals and run files; servelab.cluster imports nothing here.
"""
