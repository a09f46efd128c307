"""`LLM(device="cuda")` runs bfloat16 unless a dtype is given; elsewhere float32."""

from __future__ import annotations

import torch

from servelab.llm import with_device_dtype


def test_cuda_defaults_to_bfloat16():
    assert with_device_dtype({"device": "cuda"})["dtype"] == "bfloat16"
    assert with_device_dtype({"device": torch.device("cuda", 0)})["dtype"] == "bfloat16"


def test_a_given_dtype_or_another_device_is_kept():
    assert with_device_dtype({"device": "cuda", "dtype": "float32"})["dtype"] == "float32"
    assert "dtype" not in with_device_dtype({"device": "cpu"})
    assert "dtype" not in with_device_dtype({})
