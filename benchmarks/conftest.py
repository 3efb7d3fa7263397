"""pytest-benchmark over the cases of ``fused_transformer.tools.bench_cases``, the ones ``python -m fused_transformer
bench`` measures: ``pytest benchmarks/ --benchmark-only``. Not part of the default test run (pyproject's
testpaths is ``tests``). Options below; pytest-benchmark's own (``--benchmark-max-time``, ``--benchmark-json``,
``--benchmark-compare``) apply as usual.
"""
import pytest
import torch

from fused_transformer.tools import AUTO_DEVICE, bench_cases, resolve_device


def pytest_addoption(parser):
    group = parser.getgroup("fused_transformer benchmarks")
    group.addoption("--bench-device", default=AUTO_DEVICE,
                    help="cpu, cuda, cuda:N or auto (the default: the current CUDA device when there is one, else cpu), "
                         "as bench --device")
    group.addoption("--bench-dtype", choices=("float32", "float16", "bfloat16"), default=None,
                    help="default float32 on CPU, bfloat16 on CUDA (bench --dtype's spelling)")
    group.addoption("--bench-grid", choices=("small", "quick", "full"), default="small",
                    help="sequence lengths per suite: small = the shortest of --quick (default), quick = those of "
                         "bench --quick, full = those of bench")
    group.addoption("--bench-lengths", default=None, help="sequence lengths for every suite, e.g. 128,512")
    group.addoption("--bench-suite", action="append", choices=bench_cases.SUITES, default=None,
                    help="a suite to run; repeat for several (default: all)")


def bench_setup(config) -> bench_cases.Setup:
    try:
        device = resolve_device(config.getoption("--bench-device"))
    except ValueError as exc:
        raise pytest.UsageError(f"--bench-device: {exc}") from None
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, None: None}[
        config.getoption("--bench-dtype")]
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return bench_cases.Setup(device, dtype)


def pytest_generate_tests(metafunc):
    if {"setup", "case", "impl"} <= set(metafunc.fixturenames):
        setup, pairs = selected_cases(metafunc.config)
        metafunc.parametrize("setup", [setup], ids=[setup.device.type])
        metafunc.parametrize(("case", "impl"), pairs, ids=[f"{case.id}-{impl}" for case, impl in pairs])


def selected_cases(config):
    """The setup, and the (case, impl) pairs to parametrize over."""
    setup = bench_setup(config)
    grid, lengths = config.getoption("--bench-grid"), config.getoption("--bench-lengths")
    pairs = []
    for suite in config.getoption("--bench-suite") or bench_cases.SUITES:
        if lengths:
            suite_lengths = [int(n) for n in lengths.split(",")]
        else:
            suite_lengths = bench_cases.default_lengths(suite, setup.device, quick=grid != "full")
            suite_lengths = suite_lengths[:1] if grid == "small" else suite_lengths
        for case in bench_cases.cases(suite, setup, suite_lengths):
            pairs.extend((case, impl) for impl in case.impls)
    return setup, pairs
