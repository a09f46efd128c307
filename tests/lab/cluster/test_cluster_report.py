"""A cluster sweep's report shows how the router spread the requests, with no report option
asked: summary.md's table has each configuration's load imbalance, the requests routed to each
replica and the requests sent to a busy replica while another was idle, and replicas.png draws
the requests per replica beside each replica's time to first token. The runs are the low-load
case of test_router_balance.py (8 chats of 4 turns over 4 simulated replicas)."""

from __future__ import annotations

import csv

import pytest
from PIL import Image

from servelab.lab.cluster.cli_run import run_cluster_job
from servelab.lab.report import write_report
from tests.lab.cluster.test_router_balance import CASE

ROUTERS = ("round_robin", "prefix_affinity")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("routers")
    for job, router in enumerate(ROUTERS):
        meta = {"overrides": [f"router={router}"], "job": {"num": job},
                "choices": {"executor": "simulated", "model": "llama3-8b",
                            "hardware": "h100-sxm", "router": router, "cluster": "colocated"}}  # fmt: skip
        run_cluster_job({**CASE, "router": router}, meta, root / str(job), in_sweep=True)
    write_report([root], progress=False)
    return root


def table_row(markdown: str, router: str) -> dict[str, str]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if router in cells:
            return dict(zip(header, cells))
    raise AssertionError(f"no row for {router}")


def test_summary_md_shows_the_balance_of_every_configuration(sweep):
    markdown = (sweep / "summary.md").read_text()
    round_robin = table_row(markdown, "round_robin")
    # 32 requests in turn over 4 replicas: 8 each, the most on one over the mean is 1
    assert round_robin["requests_per_replica"] == "8 8 8 8"
    assert round_robin["load_imbalance"] == "1 *exact*"
    affinity = table_row(markdown, "prefix_affinity")
    counts = [int(n) for n in affinity["requests_per_replica"].split()]
    assert len(counts) == 4 and sum(counts) == 32 and max(counts) < 32
    assert affinity["load_imbalance"].startswith(f"{max(counts) / 8:.4g}")
    assert affinity["sent_to_busy_while_idle"] == "0 *exact*"


def test_summary_csv_keeps_the_counts_as_text(sweep):
    with open(sweep / "summary.csv", newline="") as handle:
        rows = {row["router"]: row for row in csv.DictReader(handle)}
    assert rows["round_robin"]["requests_per_replica"] == "8 8 8 8"
    assert "requests_per_replica_ci_low" not in rows["round_robin"]  # text, not an estimate


def test_replicas_plot_is_drawn_and_listed(sweep):
    assert "![replicas](replicas.png)" in (sweep / "summary.md").read_text()
    with Image.open(sweep / "replicas.png") as image:
        assert image.width > 400 and image.height > 200
        low, high = image.convert("L").getextrema()
        assert low < high


def test_a_single_cluster_run_prints_its_balance(tmp_path, capsys):
    meta = {"overrides": ["router=round_robin"],
            "choices": {"executor": "simulated", "router": "round_robin"}}  # fmt: skip
    run_cluster_job({**CASE, "router": "round_robin"}, meta, tmp_path / "run")
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    assert rows["replicas"] == "4" and rows["requests_per_replica"] == "8 8 8 8"
    assert rows["load_imbalance"] == "1" and rows["sent_to_busy_while_idle"] == "0"
