"""Fixtures shared across the test folders."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from servelab.registry import plugin_manager


@pytest.fixture(scope="module")
def test_proposers() -> Iterator[None]:
    """The testing proposers (`servelab.testing.proposers`) registered for a module:
    `pytestmark = pytest.mark.usefixtures("test_proposers")`."""
    from servelab.registry.plugin_manager import get_plugin_manager
    from servelab.testing.proposers import TestProposers

    manager = get_plugin_manager()
    plugin = TestProposers()
    manager.register(plugin, name="servelab-test-proposers")
    yield
    manager.unregister(plugin)


@pytest.fixture
def on_plugin_path(monkeypatch) -> Iterator[Callable[[Path, str], None]]:
    """`on_plugin_path(folder, module_prefix)` puts a distribution's folder on
    sys.path, as `pip install` would, and makes the process-wide plugin manager
    rebuild around it; after the test the manager is rebuilt without it and the
    modules whose names start with `module_prefix` are forgotten."""
    prefixes: list[str] = []

    def add(folder: Path, module_prefix: str) -> None:
        monkeypatch.syspath_prepend(str(folder))
        prefixes.append(module_prefix)
        plugin_manager.reset_plugin_manager()

    yield add
    plugin_manager.reset_plugin_manager()
    for name in [m for m in sys.modules if m.startswith(tuple(prefixes))]:
        del sys.modules[name]


# -- the fast tier: `pytest -m "not slow"` leaves these out; the full suite runs them.
# Slow: whole processes (servers, torchrun, CLI runs, pip builds and installs), kernel
# builds, long Hypothesis runs, and the sweeps over every combination (see SWEEPS).
SLOW = (
    "tests/test_packaging.py",
    "tests/test_benchmarks_smoke.py",
    "tests/test_cpu_ab.py",
    "tests/test_cli.py::test_joblib_launcher_runs_a_sweep_and_the_report_reads_it",
    "tests/test_cli.py::test_a_failing_job_does_not_end_its_sweep_and_the_report_lists_it",
    "tests/test_layering.py::test_allocators_import_without_torch",
    "tests/test_simulation_accuracy.py",
    "tests/engine/test_memory.py::test_nothing_lost_under_memory_pressure",
    "tests/engine/test_engine.py::test_outputs_do_not_depend_on_batch_composition",
    "tests/engine/test_engine.py::test_seeded_request_gives_same_tokens_in_any_batch",
    "tests/engine/test_engine.py::test_top_k_one_equals_greedy",
    "tests/executor/test_device_path.py::test_decode_steps_replay_through_the_model_runner",
    "tests/executor/test_device_path.py::test_throughput_benchmark_tiny_smoke",
    "tests/executor/test_tensor_parallel.py",
    "tests/executor/test_tensor_parallel_failures.py",
    "tests/executor/test_tensor_parallel_graphs.py",
    "tests/kernels/test_kernel_cache.py",
    "tests/kernels/test_cpu_kernel.py::test_an_avx2_build_agrees_with_the_native_one",
    "tests/registry/test_example_plugin.py",
    "tests/registry/test_proposer_doc.py::test_servelab_plugins_prints_what_the_page_shows",
    "tests/registry/test_proposer_doc.py::test_every_servelab_command_of_the_page_runs_the_proposer",
    "tests/registry/test_proposer_doc.py::test_the_package_tests_pass_against_the_installed_package",
    "tests/registry/test_broken_plugins.py::test_a_broken_plugin_is_one_warning",
    "tests/registry/test_typed_options.py::test_the_command_line_says_which_key_is_wrong",
    "tests/serve/test_bench.py",
    "tests/serve/test_load.py",
    "tests/lab/test_presets.py",
    "tests/lab/test_repeats.py",
    "tests/plugins/test_allocator_stateful.py",
    "tests/plugins/test_kv_tier_stateful.py",
    "tests/engine/test_kv_tier_pressure.py",
    "tests/testing/test_conformance.py",
    "tests/testing/test_conformance_proposer.py",
    "tests/test_gpu_check.py::test_dry_run_runs_every_phase_and_writes_the_report",
    "tests/executor/test_compile_graphs.py",
    "tests/executor/test_compile.py",
    "tests/executor/test_benchmark_warmup.py",
    "tests/executor/test_device_path.py::test_throughput_benchmark_compiled_row",
    "tests/engine/test_memory.py::test_paged_wastes_less_than_contiguous_at_equal_memory",
    "tests/lab/test_presets_simulated.py",
    "tests/lab/test_public_traces_runs.py",
    "tests/plugins/test_triton_sm90.py",
    "tests/step/test_decode_batch.py::test_fast_path_changes_nothing",
    "tests/test_cli.py::test_a_misspelt_option_exits_2_and_lists_the_accepted_keys",
    "tests/test_cli.py::test_the_readme_commands_run",
    "tests/test_cli.py::test_one_run_writes_its_results_and_prints_the_summary",
    "tests/test_cli.py::test_a_failing_single_run_exits_2_and_still_writes_its_results",
    "tests/test_cli.py::test_a_plugin_registered_config_option_works_on_the_command_line",
    "tests/lab/cluster/test_disaggregated_processes.py::test_two_processes_give_the_colocated_tokens",
    "tests/lab/cluster/test_disagg_presets.py",
    "tests/plugins/test_triton_kernels.py::test_interpreter_works_when_triton_language_was_imported_first",
    "tests/lab/test_report.py::test_plots_open_and_are_not_blank",
    "tests/lab/test_report.py::test_no_slot_timeline_for_large_workloads",
    "tests/lab/test_provenance.py::test_a_report_over_two_versions_warns",
    "tests/executor/test_fused_forward.py",
    "tests/engine/test_resilience.py::test_eight_threads_each_get_their_own_outputs",
    "tests/serve/test_structured_outputs.py::test_a_trained_model_follows_every_kind_offline_and_served",
)
# Parametrized sweeps over every combination: the first case of each stays in the
# fast tier (the code path is exercised), the rest are slow.
SWEEPS = (
    "tests/test_oracle.py::test_qwen3_every_combination",
    "tests/engine/test_kv_tiers.py::test_every_tier_gives_the_oracles_tokens",
    "tests/test_oracle.py::test_other_architectures",
    "tests/test_oracle_speculative.py::test_every_combination_with_drafts",
    "tests/test_oracle_speculative.py::test_every_built_in_proposer",
    "tests/test_config_compose.py::test_every_component_combination_builds",
    "tests/test_config_compose.py::test_every_option_composes",
    "tests/test_config_compose.py::test_every_preset_job_composes_and_builds",
    "tests/plugins/test_attention_backends.py::test_matches_reference_and_stores_kv",
    "tests/plugins/test_attention_backends.py::test_fast_impls_match_the_reference_impl",
    "tests/executor/test_same_decisions.py::test_simulated_makes_the_real_engines_decisions",
    "tests/engine/test_same_decisions.py::test_every_builtin_decides_as_before",
    "tests/kernels/test_cpu_fused.py::test_qk_norm_rope_matches_torch",
    "tests/kernels/test_cpu_fused.py::test_rms_norm_matches_torch",
    "tests/kernels/test_cpu_linear.py::test_matches_the_exact_product",
    "tests/engine/test_disaggregation.py::test_disaggregated_tokens_equal_colocated_and_reference",
    "tests/engine/test_structured_outputs.py::test_constrained_tokens_equal_the_masked_reference",
)


def pytest_collection_modifyitems(config, items) -> None:
    seen: set[str] = set()
    for item in items:
        node = item.nodeid
        function = node.split("[", 1)[0]
        if node.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        elif function in SWEEPS:
            if function in seen:
                item.add_marker(pytest.mark.slow)
            seen.add(function)
