"""`benchmarks/spec_pair.py --quick`: the trained pair's folder is what it
declares. servelab's loader reads the target and the draft and gives the
training code's logits and greedy tokens; the EAGLE folder holds exactly its
declared tensors; the tokenizer round-trips text; the workloads' token ids are
their prompts' encoding; the same seed gives the same weights.

The C++ CPU kernels are switched off (`SERVELAB_CPU_KERNEL=0`): building them
takes minutes on a fresh machine, and the engine's torch path is what runs.
"""

from __future__ import annotations

import importlib
import json

import pytest
from safetensors import safe_open

from servelab.model.loader import load_model
from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def spec_pair():
    return load_benchmark("spec_pair")


@pytest.fixture(autouse=True)
def one_thread(spec_pair):
    """The quick run's thread count for every check too: the models are tiny."""
    with spec_pair.torch_threads(spec_pair.QUICK.threads):
        yield


@pytest.fixture(scope="module")
def quick_run(spec_pair, tmp_path_factory):
    """(folder, manifest) of one quick run, seed 0."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SERVELAB_CPU_KERNEL", "0")
        folder = tmp_path_factory.mktemp("spec_pair") / "run"
        manifest = spec_pair.train(spec_pair.QUICK, 0, folder)
        yield folder, manifest


@pytest.fixture
def no_cpu_kernel(monkeypatch):
    monkeypatch.setenv("SERVELAB_CPU_KERNEL", "0")


def test_servelab_loads_both_models_and_serves_the_trained_logits(
    spec_pair, quick_run, no_cpu_kernel
):
    folder, manifest = quick_run
    for name, shape in (("target", spec_pair.QUICK.target), ("draft", spec_pair.QUICK.draft)):
        model, config, tokenizer = load_model(str(folder / name))
        assert config.architecture == "qwen3" and config.qk_norm and config.tie_word_embeddings
        assert (config.hidden_size, config.num_layers) == (shape.hidden_size, shape.num_layers)
        assert config.eos_token_ids == [tokenizer.token_to_id("<|endoftext|>")]
        assert sum(p.numel() for p in model.parameters()) == manifest["parameters"][name]
    report = spec_pair.verify(folder)  # asserts logits, prompt logprobs and greedy tokens
    for name in ("target", "draft"):
        assert report[name]["max_logit_diff"] <= 1e-4
        assert report[name]["greedy_equal"]


def test_the_eagle_folder_holds_exactly_its_declared_tensors(spec_pair, quick_run):
    folder, _ = quick_run
    models = importlib.import_module("spec_pair_models")  # spec_pair put it on the path
    eagle = folder / "eagle"
    config = json.loads((eagle / "config.json").read_text())
    assert config["architectures"] == ["ServelabEagleHead"]
    assert (eagle / config["target"]).resolve() == (folder / "target").resolve()
    target = json.loads((folder / "target/config.json").read_text())
    for key in ("hidden_size", "head_dim", "rms_norm_eps", "rope_theta"):
        assert config[key] == target[key]
    assert sorted(p.name for p in eagle.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(eagle / "model.safetensors", framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes == models.eagle_tensor_shapes(config)


def test_the_tokenizer_round_trips_text_and_ends_with_its_eos(quick_run):
    from tokenizers import Tokenizer

    folder, _ = quick_run
    tokenizer = Tokenizer.from_file(str(folder / "target/tokenizer.json"))
    text = 'def f(x):\n\treturn {"é": x ** 2}  # ünïcode, 日本語, emoji 🙂\n\n'
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert json.loads((folder / "target/config.json").read_text())["eos_token_id"] == eos
    assert (folder / "draft/tokenizer.json").read_bytes() == (
        folder / "target/tokenizer.json"
    ).read_bytes()


def test_each_workload_is_its_prompts_encoding_within_the_trained_length(spec_pair, quick_run):
    from tokenizers import Tokenizer

    folder, _ = quick_run
    tokenizer = Tokenizer.from_file(str(folder / "target/tokenizer.json"))
    workloads = importlib.import_module("spec_pair_workloads")
    for name in spec_pair.WORKLOADS:
        requests = workloads.read_jsonl(folder / "workloads" / f"{name}.jsonl")
        assert len(requests) == spec_pair.QUICK.requests
        assert len({r["id"] for r in requests}) == len(requests)
        for r in requests:
            assert r["prompt_token_ids"] == tokenizer.encode(r["prompt"]).ids
            assert 128 <= len(r["prompt_token_ids"]) <= 512 - r["max_tokens"]
        if name == "code_edit":
            assert all(r["renames"] and workloads.EDIT_COMMENT in r["prompt"] for r in requests)


def test_the_same_seed_gives_the_same_weights(spec_pair, quick_run, tmp_path):
    folder, manifest = quick_run
    again = spec_pair.train(spec_pair.QUICK, 0, tmp_path / "again")
    assert again["files"] == manifest["files"] == spec_pair.file_digests(folder)
    assert again["digest"] == manifest["digest"]
    other = spec_pair.run_key(spec_pair.QUICK, 1)
    assert spec_pair.digest_of(other) != manifest["digest"]


def test_a_complete_folder_is_reused(spec_pair, quick_run, capsys):
    folder, manifest = quick_run
    assert spec_pair.train(spec_pair.QUICK, 0, folder) == manifest
    assert "reusing" in capsys.readouterr().out


def test_evaluate_reports_a_fraction_per_proposer_and_workload(spec_pair, quick_run, no_cpu_kernel):
    folder, _ = quick_run
    results = spec_pair.evaluate(folder)
    assert set(results) == set(spec_pair.WORKLOADS)
    for figures in results.values():
        assert figures["positions"] == spec_pair.QUICK.requests * 128
        for name in ("draft", "eagle", "ngram", "training_target"):
            assert 0.0 <= figures[name] <= 1.0
        assert figures["training_target"] >= 0.99  # the engine's greedy tokens, re-read


def test_the_vllm_side_by_side_serves_the_pair_through_its_servelab_worker(
    quick_run, no_cpu_kernel
):
    """benchmarks/spec_vllm_peer.py's servelab side: n-gram lookup gives no speculation's
    tokens, every request its `max_tokens` (ignore_eos, as vLLM is asked), and counts its
    verifications."""
    peer = load_benchmark("spec_vllm_peer")
    spec_decode = load_benchmark("spec_decode")
    folder, _ = quick_run
    engines = peer.servelab_engines(folder, [1, 4], threads=1)
    requests = spec_decode.load_workload(folder, "code_edit")[:4]
    plain = peer.servelab_run(engines["none", 4], requests)
    ngram = peer.servelab_run(engines["ngram", 4], requests)
    assert ngram["tokens"] == plain["tokens"]
    assert [len(t) for t in plain["tokens"]] == [r["max_tokens"] for r in requests]
    assert plain["verifications"] == 0 and ngram["verifications"] > 0
    assert peer.servelab_run(engines["ngram", 1], requests)["tokens"] == plain["tokens"]


def test_the_side_by_side_summary_pairs_the_systems_by_repeat():
    """Ratios and agreement from runs whose values are set here: servelab twice as fast
    as vLLM in every repeat, n-gram 1.5x none on both, 3 of 4 tokens agreeing."""
    peer = load_benchmark("spec_vllm_peer")
    runs = {}
    for system, base in (("servelab", 1.0), ("vllm", 2.0)):
        for proposer, factor in (("none", 1.0), ("ngram", 1 / 1.5)):
            tokens = [[1, 2, 3, 4]] if system == "servelab" else [[1, 2, 3, 9]]
            runs[system, "w", 1, proposer] = [
                {"seconds": base * factor * (1 + repeat / 10), "tokens": tokens,
                 "verifications": 0 if proposer == "none" else 2,
                 "accepted": 0 if proposer == "none" else 3}
                for repeat in range(3)
            ]  # fmt: skip
    rows = peer.summarise(runs, [("w", 1)])
    none, ngram = rows
    assert none["servelab_vs_vllm"] == pytest.approx(2.0)
    assert ngram["servelab"]["vs_none"] == pytest.approx(1.5)
    assert ngram["vllm"]["vs_none"] == pytest.approx(1.5)
    assert ngram["servelab"]["mean_accepted_length"] == pytest.approx(1 + 9 / 6)
    assert none["servelab"]["mean_accepted_length"] is None
    assert ngram["token_agreement"] == pytest.approx(0.75)
    assert ngram["servelab"]["same_tokens_as_none"] and ngram["vllm"]["same_tokens_as_none"]
    assert "| w | 1 | ngram |" in peer.markdown(
        {"cpu": "x", "repeats": 3, "pair": "p", "rows": rows}
    )
