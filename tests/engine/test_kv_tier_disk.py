"""The `disk` tier's folder across engines: a second engine on the same folder
loads what the first computed instead of prefilling it, and a file it cannot
trust (truncated, altered, another prefix's, another model's or block size's,
K/V of another shape)
or a write the disk refuses costs a recompute and one warning, never a wrong
token. Every run is checked against transformers' tokens (the oracle's case).
"""

from __future__ import annotations

import errno
import logging

import pytest

from servelab import LLM
from servelab.plugins.kv_tiers import block_file
from servelab.plugins.kv_tiers.block_file import SUFFIX, identity_digest, write_block
from servelab.testing.oracle import cached_case, engine_options, restored_num_threads

LONG = 10  # the oracle's 40-token prompt: 9 full blocks of 4 before its last token
PAGED = {"name": "paged", "block_size": 4, "prefix_caching": True}
COMBO = {"scheduler": {"name": "continuous"}, "attention": "per_request"}
LOGGER = "servelab.plugins.kv_tiers.disk"


def engine(folder, allocator=PAGED, **tier) -> LLM:
    case = cached_case("qwen3")
    return LLM(
        model=str(case.folder),
        allocator=allocator,
        kv_tier={"name": "disk", "path": str(folder), **tier},
        **COMBO,
        **engine_options(COMBO),
    )


def run_long(llm: LLM) -> tuple[list[int], int]:
    """The long prompt's tokens (checked against transformers') and the prompt
    tokens this engine prefilled for it."""
    case = cached_case("qwen3")
    before = sum(s.prefill_tokens for s in llm.engine.metrics.steps)
    with restored_num_threads():
        out = llm.generate([case.prompts[LONG]], case.params[LONG])[0]
    tokens = out.outputs[0].token_ids
    assert tokens == case.expected[LONG], "a disk tier changed the tokens"
    llm.engine.allocator.check_integrity()
    llm.engine.kv_tier.check_integrity()
    return tokens, sum(s.prefill_tokens for s in llm.engine.metrics.steps) - before


def block_files(folder) -> list:
    return sorted(folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)


def prompt_block_file(folder, llm: LLM, index: int):
    """The file of the long prompt's block `index` (0: its first 4 tokens)."""
    from servelab.contracts.kv_tier import block_key

    tokens = cached_case("qwen3").prompts[LONG]
    key = None
    for i in range(index + 1):
        key = block_key(key, tokens[i * 4 : (i + 1) * 4])
    return folder / block_file.file_name(key, llm.engine.kv_tier.identity)


def test_a_second_engine_loads_what_the_first_computed(tmp_path):
    first = engine(tmp_path)
    _, prefilled_first = run_long(first)
    assert prefilled_first == len(cached_case("qwen3").prompts[LONG])
    written = block_files(tmp_path)
    assert len(written) >= 9  # the prompt's full blocks, and its output's, written through

    second = engine(tmp_path)
    _, prefilled_second = run_long(second)
    figures = second.engine.kv_tier.figures
    assert figures.hits == 9 and figures.hit_tokens == 36 and figures.load_failures == 0
    assert prefilled_second == len(cached_case("qwen3").prompts[LONG]) - 36


def corrupt_truncated(path, llm):
    path.write_bytes(path.read_bytes()[:-7])


def corrupt_flipped_byte(path, llm):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def corrupt_other_model(path, llm):
    key, _ = block_file.parse_name(path.name)
    tokens = tuple(cached_case("qwen3").prompts[LONG][8:12])
    kv = block_file.read_block(path, key, tokens, llm.engine.kv_tier.identity)
    write_block(path, key, tokens, identity_digest({"model": "another"}), kv)


def corrupt_other_prefix(path, llm):
    key, _ = block_file.parse_name(path.name)
    tokens = tuple(cached_case("qwen3").prompts[LONG][8:12])
    kv = block_file.read_block(path, key, tokens, llm.engine.kv_tier.identity)
    write_block(path, key, (1, 2, 3, 4), llm.engine.kv_tier.identity, kv)


def corrupt_other_shape(path, llm):
    key, _ = block_file.parse_name(path.name)
    tokens = tuple(cached_case("qwen3").prompts[LONG][8:12])
    kv = block_file.read_block(path, key, tokens, llm.engine.kv_tier.identity)
    write_block(path, key, tokens, llm.engine.kv_tier.identity, kv[:, :, :2])


def corrupt_not_a_block(path, llm):
    path.write_text("not K/V")


@pytest.mark.parametrize(
    "corrupt,reason",
    [
        (corrupt_truncated, "is truncated"),
        (corrupt_flipped_byte, "fails its checksum"),
        (corrupt_other_model, "was written for another model"),
        (corrupt_other_prefix, "holds another prefix's block"),
        (corrupt_other_shape, "holds K/V of shape"),
        (corrupt_not_a_block, "is not a servelab KV block file"),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_a_damaged_file_is_recomputed_with_one_warning(tmp_path, caplog, corrupt, reason):
    first = engine(tmp_path)
    run_long(first)
    damaged = prompt_block_file(tmp_path, first, 2)
    corrupt(damaged, first)

    second = engine(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _, prefilled = run_long(second)
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and reason in warnings[0] and damaged.name in warnings[0], warnings
    figures = second.engine.kv_tier.figures
    # blocks 0 and 1 loaded; block 2 failed, so it and everything after it were computed
    assert figures.load_failures == 1 and figures.hits == 2
    assert prefilled == len(cached_case("qwen3").prompts[LONG]) - 8
    # the damaged file was replaced by the block computed again (written through)
    key, _ = block_file.parse_name(damaged.name)
    tokens = tuple(cached_case("qwen3").prompts[LONG][8:12])
    block_file.read_block(damaged, key, tokens, second.engine.kv_tier.identity)


def test_a_folder_of_another_block_size_is_never_read(tmp_path, caplog):
    run_long(engine(tmp_path))  # blocks of 4
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        other = engine(tmp_path, allocator={**PAGED, "block_size": 8})
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and "another model, dtype or block size" in warnings[0], warnings
    _, prefilled = run_long(other)
    assert (
        other.engine.kv_tier.figures.hits == 0 and other.engine.kv_tier.figures.load_failures == 0
    )
    assert prefilled == len(cached_case("qwen3").prompts[LONG])


def test_a_full_disk_drops_blocks_with_one_warning(tmp_path, caplog, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("servelab.plugins.kv_tiers.disk.write_block", full)
    llm = engine(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run_long(llm)
        run_long(llm)  # again: nothing was kept, so nothing below the device cache loads
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
    figures = llm.engine.kv_tier.figures
    assert figures.blocks_dropped > 0 and figures.blocks_dropped == figures.blocks_stored
    assert not block_files(tmp_path) and llm.engine.kv_tier.stats()["disk_blocks"] == 0
