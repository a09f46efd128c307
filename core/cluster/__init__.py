"""servelab.cluster: what engines behind a router are made of, whoever runs them.

The dispatcher (`dispatch`: the router part, servelab.contracts.router, deciding from the
replicas' published state), the OpenAI-compatible proxy and `servelab route` (`proxy`,
`route_cli`), the KV wire between a prefill and a decode process (`kv_wire`), the links a
KV transfer crosses (`links`) and the `cluster:` config node (`options`). It sits below the
experiment harness: the simulated cluster, the disaggregated runs and their command-line
jobs are servelab.lab.cluster, which imports this package, never the reverse. See
docs/cluster.md.
"""
