"""Test session setup shared by every test folder."""

import logging
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on the CPU machines.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _quiet_torch_trace() -> None:
    # torch's structured-trace logger ("torch.__trace", always DEBUG) never propagates, and
    # pytest attaches its capture handler to every logger that does not: torch then sees a
    # handler, builds the trace payload of every compile event and logs it (about 3,000 DEBUG
    # lines in one failure report of tests/test_realmodel.py). A propagating logger keeps
    # pytest's handler off it, and without TORCH_TRACE torch's own lazy handler, which would
    # remove itself at the first record, goes now: torch builds no payload and logs nothing.
    trace = logging.getLogger("torch.__trace")
    trace.propagate = True
    for h in list(trace.handlers):
        if type(h).__name__ == "LazyTraceHandler" and getattr(h, "root_dir", "") is None:
            trace.removeHandler(h)


_quiet_torch_trace()


def _share_cores_among_xdist_workers() -> None:
    # scripts/test.sh runs one pytest-xdist worker per core: each worker's intra-op threads get
    # its share of the cores (2 workers x 2 threads on 2 cores stall each other), and so do the
    # interpreters that tests start (README blocks, examples, tensor-parallel ranks).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // workers)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


_share_cores_among_xdist_workers()


def _share_gguf_parse() -> None:
    # SmolLM2-135M is loaded about six times in a run (test_realmodel, the CLI's real-model
    # tests, README blocks, examples/chat.py), each a GGUF parse (16 s of CPU, about 30 s on
    # 2 busy cores):
    # tests/gguf_cache.py parses it once per run. The controller (or the one process) makes the
    # run's folder; xdist workers inherit it through the environment.
    from tests import gguf_cache

    if os.environ.get("PYTEST_XDIST_WORKER") is None and gguf_cache.VAR not in os.environ:
        import tempfile

        os.environ[gguf_cache.VAR] = tempfile.mkdtemp(prefix="kvcompile-test-gguf-")
        _OWNED.append(os.environ[gguf_cache.VAR])
    if os.environ.get(gguf_cache.VAR):
        gguf_cache.install(os.environ[gguf_cache.VAR])


_OWNED: list = []
_share_gguf_parse()


def pytest_sessionfinish(session, exitstatus):
    from tests import gguf_cache

    for folder in _OWNED:
        gguf_cache.remove(folder)


@pytest.fixture(autouse=True)
def _quiet_logs():
    """Again before each test: torch._logging.set_logs (a test checking recompile logs)
    resets the logger."""
    _quiet_torch_trace()


def _hidden_torch_options() -> dict:
    """{name: config entry} of the options of torch's config modules that a test left deleted.
    pytest >= 9's monkeypatch undoes an option it set on such a module by deleting it (the
    option is not in the module's __dict__), which hides it from every later compile in the
    worker; CI once failed a test of another file that way."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    return {f"{mod.__name__}.{name}": entry for mod in (dynamo_config, inductor_config)
            for name, entry in getattr(mod, "_config", {}).items() if getattr(entry, "hide", 0)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: Dynamo caches compiled code on code objects. After
    it, no torch option may be left hidden (the test that did it fails, not a later one)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    hidden = _hidden_torch_options()
    if hidden:
        for entry in hidden.values():
            entry.hide = False
        pytest.fail(f"this test left torch options deleted: {sorted(hidden)}; set them with "
                    "the module's own patch() (e.g. torch._inductor.config.patch(...)), not "
                    "monkeypatch.setattr")


@pytest.fixture
def one_thread():
    """Tiny tensors only: with intra-op threads, a loaded 2-core CI machine stalls each op."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def dynamo_per_module():
    """For folders that compile a model once per module instead of once per test (compiling
    is most of their time on the CPU): they override `_fresh_dynamo` and use this."""
    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = limit


def _heavy_files_first(items) -> None:
    """Under pytest-xdist (--dist loadfile --no-loadscope-reorder, as scripts/test.sh runs it)
    files are handed out in this order: the files with `slow` or `realmodel` tests (a minute or
    more each, one SmolLM2 load and compile after another) go first, so that none of them starts
    last and runs on one core while the other worker sits idle. The order is otherwise kept."""
    heavy = {item.path for item in items
             if item.get_closest_marker("slow") or item.get_closest_marker("realmodel")}
    items[:] = sorted(items, key=lambda item: item.path not in heavy)


# Tests the default run leaves to KVCOMPILE_TEST_FULL=1, to keep the test command within its
# 25 minutes on 2 CPU cores (README, "The two commands"): node-id prefixes -> what still covers
# the same ground in the default run. Per-file choices of the same kind are made in the files
# themselves (grep KVCOMPILE_TEST_FULL).
FULL_ONLY = {
    # sm_90 compiles of Triton kernels (shared memory, registers, wgmma, pipelining): static
    # facts of a kernel's source and the triton version, which change only with them; run
    # them after editing a kernel (the device's GPU tests build the same kernels for real).
    # The default run keeps tests/kernels/test_move_cells_sm90.py and the CUDA kernels'
    # nvcc builds (test_decode_sm90_nvcc.py, test_latent_sm90.py) as the toolchain's check.
    "tests/kernels/test_append_sm90.py::": "sm_90 compile of the append kernels",
    "tests/kernels/test_latent_decode_sm90.py::": "sm_90 compile of the latent Triton tiles",
    "tests/kernels/test_prefill_gather_sm90.py::test_gather_kernel_compiles_for_sm90":
        "sm_90 compile of the prefill gather kernel",
    "tests/kernels/test_decode_rot_sm90.py::test_decode_kernel_with_rotated_keys_compiles_":
        "sm_90 compile of the rotated-key decode kernel",
    "tests/kernels/test_prompt_mass_sm90.py::test_prompt_mass_kernels_compile_for_sm90":
        "sm_90 compile of the prompt-mass kernels",
    # formats and policies the other cases of the same test take in the default run
    "tests/integrations/test_hf_graphs_eviction.py::test_graph_steps_with_eviction_equal_the_"
    "host_path[H2O, ": "H2O in generate's graphs over fp8 page scales and fp4 (its case over "
    "the default pages stays; H2O over fp8 and int4 pages, in generate and the Engine: "
    "tests/engine/test_engine_eviction.py::test_storage_formats_compose_with_eviction)",
    "tests/integrations/test_hf_graphs_eviction.py::test_latent_layers_step_aside_and_equal_"
    "the_host_path[H2O": "H2O on latent pages in generate's graphs (the latent SinkWindow case "
    "in graphs stays; H2O on latent pages eagerly: tests/eviction/test_latent_eviction.py)",
    "tests/integrations/test_hf_graphs_eviction.py::test_graph_steps_with_eviction_equal_the_"
    "host_path[SnapKV hold, int4 channel keys]": "SnapKV in generate's graphs over re-encoded "
    "tokens (its fp8 page-scale cases stay; int4 graphs: tests/gpu/test_int_graphs_gpu.py)",
    "tests/eviction/test_latent_eviction.py::test_engine_prefill_eviction_chunks_on_latent_":
        "prefill eviction in the Engine's chunks over latent pages (the same over plain pages: "
        "tests/engine/test_engine_prefill_eviction.py; latent prefill eviction in generate "
        "stays)",
    "tests/engine/test_soak.py::test_soak[fp32]": "the engine soak (the fp8 case stays)",
    "tests/engine/test_soak.py::test_soak[int4]": "the engine soak (the fp8 case stays)",
    "tests/engine/test_engine_window_ops.py::test_steps_that_need_more_still_step_aside[policy1":
        "window steps stepping aside (the policy0 cases stay)",
    "tests/engine/test_graphs_emulated.py::test_latent_layers[H2O]":
        "H2O on latent layers between engine replays (H2O on latent pages: tests/eviction/"
        "test_latent_eviction.py; the Engine's graphs: test_latent_layers[no eviction])",
    "tests/engine/test_engine_eviction.py::test_storage_formats_compose_with_eviction[bf16]":
        "formats under eviction in the engine (fp8 and int4 cases stay)",
    "tests/engine/test_graphs_emulated.py::test_eviction_between_replays":
        "SnapKV between the Engine's emulated graph replays (SnapKV between generate's graph "
        "replays: test_hf_graphs_eviction's SnapKV cases; the Engine's eviction: "
        "tests/engine/test_engine_eviction.py; the Engine's graphs: test_latent_layers)",
    "tests/eviction/test_end_to_end.py::test_decode_kernel_path_matches_reference[policy1]":
        "the second policy through the decode kernel (policy0 stays)",
    "tests/eviction/test_end_to_end.py::test_fresh_prompt_attends_through_sdpa_and_keeps_the_"
    "same_tokens[policy1]": "the second policy's fresh prompt (policy0 stays)",
    "tests/eviction/test_end_to_end.py::test_policies_combine_with_formats[fp4_e2m1]":
        "policies over fp4 pages (bf16 and fp8 stay; fp4 re-encoded on eviction: "
        "test_hf_graphs_eviction's test_re_encoding_formats_evict_on_the_device[fp4_e2m1])",
    "tests/engine/test_engine_nan.py::test_nan_request_fails_alone_on_the_triton_path[fp8":
        "a NaN request over fp8 pages in the Engine (the fp32 case stays; NaN over fp8 pages "
        "in the kernels: tests/kernels/test_nan.py)",
    "tests/integrations/test_device_loop.py::test_evicting_models_run_their_steps_through_the_"
    "forward[H2O]": "H2O through the device loop's forward steps (its left-padded case stays)",
    "tests/integrations/test_device_loop.py::test_calls_the_loop_does_not_take_keep_"
    "transformers_loop_and_say_why[sample_penalty": "a penalty refused under sampling (the "
    "greedy penalty case stays)",
    "tests/integrations/test_device_loop.py::test_a_streamer_gets_every_token_a_step_late_and_"
    "none_past_the_stop[to max_new_tokens]": "the device loop's streamer to the length limit "
    "(its EOS case, the stop included, stays)",
    # a case whose twin (another kernel route, policy or format of the same test) stays
    "tests/eviction/test_latent_eviction.py::test_h2o_mass_is_the_models_attention[reference]":
        "the reference route's H2O mass on latent pages (the Triton route's stays)",
    "tests/eviction/test_latent_eviction.py::test_h2o_prompt_mass_absorbs_in_blocks[reference]":
        "the reference route's prompt mass on latent pages (the Triton route's stays)",
    "tests/eviction/test_latent_eviction.py::test_sink_window_equals_masked_attention[auto]":
        "SinkWindow on latent pages with kernels='auto' (the Triton case stays)",
    "tests/engine/test_engine_mixed_eviction.py::test_h2o_prompt_chunks_attend_plain_and_add_up_"
    "their_mass[reference]": "the reference route's H2O prompt chunks (the Triton route's stays)",
    "tests/engine/test_engine_mixed_eviction.py::test_prompt_chunks_beside_evicted_rows_attend_"
    "plain[sinkwindow]": "SinkWindow rows beside prompt chunks (the SnapKV case stays)",
    "tests/engine/test_engine_mixed_eviction.py::test_decode_kernel_reads_the_kept_length["
    "sinkwindow]": "SinkWindow's kept length in the decode kernel (the SnapKV case stays)",
    "tests/eviction/test_end_to_end.py::test_h2o_prompt_attends_plain_with_the_same_mass["
    "reference]": "the reference route's H2O prompt (the Triton route's stays)",
    "tests/integrations/test_hf_graphs_eviction.py::test_left_padding_replays_once_evicted["
    "SinkWindow": "left padding under SinkWindow in generate's graphs (the SnapKV case stays)",
    "tests/integrations/test_hf_graphs_eviction.py::test_graph_steps_with_eviction_equal_the_"
    "host_path[SinkWindow window, interval 4]": "SinkWindow with an interval in generate's "
    "graphs (the re-rotated SinkWindow and the SnapKV interval cases stay)",
    "tests/engine/test_engine_eviction.py::test_random_arrivals_quantized_eviction_preemption_"
    "prefix[int4-channel]": "random arrivals over int4 channel pages (the same with residual "
    "pages and over fp8 stay)",
    "tests/kernels/test_nan.py::test_decode_nan_reaches_the_queries_that_see_it[int3-":
        "a NaN through int3 pages' decode (int4 and int2 stay)",
    # quantized pages on a family beside the formats its other cases take (gemma2: bf16 and
    # e4m3 stay; fp4: llama and mistral stay; qwen3: e4m3 stays)
    "tests/passes/test_hf_families.py::test_quantized_pages_stay_close[gemma2-eager-fp4_e2m1]":
        "fp4 pages on gemma2",
    "tests/passes/test_hf_families.py::test_quantized_pages_stay_close[gemma2-eager-fp8_e5m2]":
        "e5m2 pages on gemma2",
    "tests/passes/test_hf_families.py::test_quantized_pages_stay_close[qwen3-eager-fp4_e2m1]":
        "fp4 pages on qwen3",
    # a tool's children: three families in subprocesses (the sweep's doc and config tests stay;
    # the 12 families compiled: tests/passes/test_hf_families.py)
    "tests/passes/test_coverage_sweep.py::test_sweep_subset": "the coverage sweep's child runs",
    # SmolLM2 runs (30-40 s each) whose ground a tiny model's test covers: fp32 pages token-
    # identical to eager (the 12 families of tests/passes/test_hf_families.py), the CLI's
    # inspect --verify (tests/cli/test_cli.py's verify tests); SmolLM2 itself stays in the
    # demo, README, perplexity and teacher-forced tests
    "tests/test_realmodel.py::test_smollm2_fp32_pages_token_identical_to_eager":
        "fp32 pages token-identical to eager on SmolLM2",
    "tests/cli/test_realmodel.py::test_inspect_verify_smollm2": "inspect --verify on SmolLM2",
    "tests/engine/test_examples.py::test_chat_with_smollm2":
        "the chat example on SmolLM2 (the Engine's prefix cache across turns: the tiny-model "
        "prefix-cache tests of tests/engine; the other examples run)",
    # a benchmark tool's feature: the quality harness's streams resumed in parts
    "tests/eviction/test_quality_harness.py::test_parts_of_a_stream_join_into_the_full_stream":
        "the quality harness's parts (its other tests stay)",
    # loads SmolLM2 for one line of a log; the demo and README tests load it the same way
    "tests/cli/test_progress.py::test_loading_smollm2_into_a_log_draws_no_conversion_bar":
        "SmolLM2's load into a log (the demo and README tests load it)",
}


def _full_only(items) -> None:
    if os.environ.get("KVCOMPILE_TEST_FULL"):
        return
    for item in items:
        why = next((w for prefix, w in FULL_ONLY.items() if item.nodeid.startswith(prefix)),
                   None)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=f"KVCOMPILE_TEST_FULL=1: {why}"))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _heavy_files_first(items)
    _full_only(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
