"""`servelab.kernels.huge_pages`: large CPU weights in mappings advised for 2 MiB
pages, with the values a plain tensor would hold, and plain tensors wherever the
system refuses."""

from __future__ import annotations

import dataclasses
import mmap
import sys

import pytest
import torch

from servelab.kernels import huge_pages
from servelab.model.loader import load_model
from servelab.model.transformer import Transformer

needs_linux = pytest.mark.skipif(sys.platform != "linux", reason="huge pages are Linux's")


def mapping_fields(address: int) -> dict[str, list[str]]:
    """The /proc/self/smaps fields (`Rss:`, `VmFlags:`, ...) of the mapping holding
    `address`, each as its words."""
    inside, fields = False, {}
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if inside:
                break
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            fields[head] = line.split()[1:]
    assert fields, f"no mapping holds {address:#x}"
    return fields


def vm_flags(address: int) -> list[str]:
    return mapping_fields(address)["VmFlags:"]


@needs_linux
def test_a_large_tensor_starts_a_huge_page_in_an_advised_mapping():
    t = huge_pages.empty((3, 2**20), torch.float32)  # 12 MiB
    assert t.shape == (3, 2**20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in vm_flags(t.data_ptr())  # MADV_HUGEPAGE
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * t.numel()


@needs_linux
def test_zeros_takes_its_pages_when_made():
    """The KV pool's `zeros` writes its pages through at once, as `torch.zeros`
    does: the mapping is resident before anything stores K/V in it (else the first
    steps would fault it in, 2 MiB page by page)."""
    t = huge_pages.zeros((2, 2**20), torch.float32)  # 8 MiB
    assert "hg" in vm_flags(t.data_ptr())
    resident_kib = int(mapping_fields(t.data_ptr())["Rss:"][0])
    assert resident_kib * 1024 >= t.numel() * 4
    assert torch.count_nonzero(t) == 0


def test_a_small_tensor_is_a_plain_one():
    t = huge_pages.empty((100, 10), torch.bfloat16)
    assert t.shape == (100, 10) and t.dtype == torch.bfloat16
    assert t.untyped_storage().nbytes() == t.numel() * 2  # no mapping of its own


def test_a_copy_has_the_values_and_outlives_its_source():
    source = torch.randn(1024, 1024, dtype=torch.float64)
    copied = huge_pages.copy(source)
    expected = source.clone()
    del source
    assert torch.equal(copied, expected)


@needs_linux
def test_the_model_allocates_its_large_weights_in_advised_mappings():
    """A shape whose fused q/k/v, o and embedding are 2 MiB or more: each starts a
    huge page of an advised mapping, and the fused views stay current."""
    _, config, _ = load_model("tiny", "float32", "cpu")
    big = dataclasses.replace(config, hidden_size=1024, vocab_size=1024, num_heads=8,
                              num_kv_heads=4, head_dim=128, intermediate_size=2048, num_layers=1)  # fmt: skip
    model = Transformer(big, torch.float32, "cpu")
    attn = model.model.layers[0].self_attn
    assert attn.qkv.is_current() and model.model.layers[0].mlp.gate_up.is_current()
    for weight in (attn.qkv.weight, attn.o_proj.weight, model.model.embed_tokens.weight):
        assert weight.data_ptr() % huge_pages.HUGE_PAGE == 0
        assert "hg" in vm_flags(weight.data_ptr())
    norm = model.model.layers[0].input_layernorm.weight  # 4 KiB: a plain tensor
    assert norm.untyped_storage().nbytes() == norm.numel() * 4


def test_a_refused_mapping_falls_back_to_plain_tensors(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no mappings here")

    monkeypatch.setattr(mmap, "mmap", refuse)
    monkeypatch.setattr(huge_pages, "_refused", [])
    t = huge_pages.empty((2**20,), torch.float32)
    assert t.shape == (2**20,) and not huge_pages.available()
    assert huge_pages.copy(torch.ones(2**20)).sum() == 2**20  # and nothing more is tried


def test_another_device_gets_torchs_own_tensor():
    for make in (huge_pages.empty, huge_pages.zeros):
        t = make((2, 2**20), torch.float32, "meta")
        assert t.device.type == "meta" and t.shape == (2, 2**20)


@pytest.mark.parametrize("shape", [(7, 3), (2, 2**20)])
def test_zeros_are_zeros_small_or_large(shape):
    t = huge_pages.zeros(shape, torch.float32)
    assert t.shape == shape and not t.any()
