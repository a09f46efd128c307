"""Link profiles: what moving a request's KV cache between two instances costs.

A transfer of `b` bytes over a link takes `latency + b / bandwidth` seconds; a request's
KV cache is `2 (K and V) x layers x KV heads x head dim x element size` bytes per token. Figures are
per direction, for one GPU's share of the link, from the vendors' datasheets: NVLink 4
(H100 SXM, 900 GB/s aggregate, 450 GB/s each way), InfiniBand NDR (400 Gb/s = 50 GB/s per
port) and PCIe 5.0 x16 (64 GB/s nominal, about 50 GB/s achieved). Latencies are the order
of a small message's one-way time on each; a real transfer adds its software stack's.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.errors import ConfigError


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def transfer_seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("nvlink", 450e9, 2e-6),
        Link("infiniband", 50e9, 5e-6),
        Link("pcie", 50e9, 10e-6),
    )
}


# where a KV tier keeps blocks below the device cache (servelab.contracts.kv_tier), as the
# simulated executor prices a tier's copies: host memory over the device's host link (its
# hardware profile's bandwidth, PCIe's latency), a tier's own storage over one NVMe SSD as
# well (PCIe 4.0 x4 datacenter drives: about 7 GB/s sequential, e.g. Samsung PM9A3 or
# Kioxia CM6; a read's latency of the order of 0.1 ms)
STORAGE_LINKS: dict[str, Link] = {
    link.name: link for link in (Link("nvme", 7e9, 100e-6),)
}


def link(name: str) -> Link:
    if name not in LINKS:
        raise ConfigError(f"unknown cluster.link {name!r}; links: {', '.join(LINKS)}")
    return LINKS[name]
