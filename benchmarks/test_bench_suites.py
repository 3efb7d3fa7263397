"""One pytest-benchmark test per (case, implementation) of ``fused_transformer.tools.bench_cases``; the tests of a case
share a benchmark group, so pytest-benchmark's table sets ours beside its baselines. The case list, the work
counted and the timed call (gradients reset, then the call, then a device sync) are the suite module's."""
import warnings

import pytest

from fused_transformer.tools import bench_cases, bench_timing, bench_work


def test_bench(benchmark, setup, case, impl):  # parametrized by conftest.pytest_generate_tests
    built = case.build()
    fn = bench_timing.runner(built.fns[impl], built.grads, setup.device)
    with warnings.catch_warnings():
        if impl in built.quiet or bench_cases.is_competitor(impl):
            warnings.simplefilter("ignore", UserWarning)  # SDPA explains each backend that refuses the case
        try:
            fn()  # warm-up, and whether this implementation takes the case at all
        except (RuntimeError, ValueError, NotImplementedError) as exc:
            if not bench_cases.is_competitor(impl):
                raise
            pytest.skip(f"{impl} refuses this case: {str(exc).splitlines()[0]}")
        benchmark.group = case.id
        benchmark.extra_info.update(suite=case.suite, case=case.case, mode=case.mode, impl=impl,
                                    seq_len=case.seq_len, baseline=case.baseline)
        benchmark(fn)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        ms = stats.stats.median * 1e3
        benchmark.extra_info["tokens_per_s"] = bench_work.tokens_per_s(case, ms)
        if case.flops is not None:
            benchmark.extra_info["tflops"] = bench_work.tflops_of(case, ms)
        if case.nbytes is not None:
            benchmark.extra_info["gb_per_s"] = bench_work.gbps_of(case, ms)
