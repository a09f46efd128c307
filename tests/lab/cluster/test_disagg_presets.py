"""The colocated-vs-disaggregated presets end to end at a reduced size (`servelab -m
experiment=PRESET`, then the report): the direction of their claims, the capacity table and
the goodput plot. A virtual clock makes every figure exact: no retries."""

from __future__ import annotations

from PIL import Image

from tests.lab.test_presets import run_preset


def test_disagg_prompt_heavy_h100(tmp_path):
    runs = run_preset(tmp_path, "disagg_prompt_heavy_h100", "workload.num_requests=60",
                      "workload.rate=8,16", "cluster=colocated,pd_2_2")  # fmt: skip
    colocated, split = runs["colocated/16"], runs["pd_2_2/16"]
    # whole 2048-token prompts beside running decodes: colocated gaps pass 50 ms
    assert split["slo_attainment_pct"] >= 90 > colocated["slo_attainment_pct"]
    assert split["goodput_rps"] > colocated["goodput_rps"]
    assert split["itl_p99_ms"] < colocated["itl_p99_ms"]
    # Llama-3-8B bf16: 128 KiB of K and V per token over NVLink's 450 GB/s, each request's
    # prompt (at least 256 tokens) takes at least 2 us + 256 x 131072 / 450e9 s
    assert split["transfer_ms_p50"] > 1000 * (2e-6 + 256 * 131072 / 450e9)
    out = tmp_path / "disagg_prompt_heavy_h100"
    summary = (out / "summary.md").read_text()
    assert "| configuration | capacity (req/s) |" in summary and "cluster=pd_2_2" in summary
    with Image.open(out / "goodput.png") as image:
        assert image.width > 100 and image.height > 100
        low, high = image.convert("L").getextrema()
        assert low < high
