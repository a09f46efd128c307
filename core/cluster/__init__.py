"""servelab.cluster: engines behind a router, simulated on one virtual clock or real
(`servelab route` in front of `servelab serve` replicas), and prefill/decode
disaggregation. The router part (servelab.contracts.router) decides in both; see
docs/cluster.md."""
