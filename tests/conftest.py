"""Test setup. Without a GPU the Triton kernels run on CPU tensors under the Triton interpreter, which must be
switched on before triton is first imported: that is why this happens here, at collection."""
import os
import signal
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Route rows a developer's `tune` left in the user's cache would change which path the tests' calls take: the tests
# read none (tests/test_route.py writes its own into temporary folders).
os.environ["FUSED_TRANSFORMER_CACHE"] = tempfile.mkdtemp(prefix="fused_transformer_test_cache_")
# Likewise the built-in CPU rows, measured on a few CPUs (route.MEASURED_DEVICES): the tests route this CPU's calls as
# one nobody measured, so that they decide alike on every machine (tests/test_route.py checks the rows themselves).
os.environ["FUSED_TRANSFORMER_ROUTE_CPU"] = "cpu-unmeasured-t1"

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_backend():
    """Every test starts on the default backend, whatever an earlier test chose."""
    from fused_transformer import backend

    saved = backend.get_backend()
    yield
    backend.set_backend(saved)


@pytest.fixture(autouse=True)
def _float32_matmuls_in_float32():
    """float32 matmuls in full float32 (torch's default), whatever a test or an import set before: the kernels' float32
    is exact unless a test asks for tf32, and so must be the float32 PyTorch they are compared with (the 2x rule's
    baseline, torch.nn twins). On a GPU, "high" would run those in TF32 (10 mantissa bits)."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(saved)


@pytest.fixture
def interpreter_off(monkeypatch):
    """As a process started without TRITON_INTERPRET would see it: the fact is read once per process, so it is
    forgotten here (with what the backend derived from it) and again when the test ends."""
    from fused_transformer import backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    backend.triton_interpreting.cache_clear()
    yield
    monkeypatch.undo()
    backend.triton_interpreting.cache_clear()


@pytest.fixture
def interpreter_rounds_to_nearest():
    """The Triton interpreter truncates float32 -> bfloat16 casts where a GPU rounds to nearest: make it round,
    so interpreted kernels are held to the GPU's rounding error, not twice that."""
    from fused_transformer.tools.numerics import interpreter_rounds_to_nearest

    with interpreter_rounds_to_nearest():
        yield


@pytest.fixture
def nan_filled_outputs():
    """Every floating buffer allocated with torch.empty / empty_like starts as NaN, so an element a kernel
    forgets to write shows up in the comparison."""
    from fused_transformer.tools.numerics import unwritten_elements_are_nan

    with unwritten_elements_are_nan():
        yield


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in this process for the test, as in a terminal, also when the tests were
    started with SIGINT ignored (see tests/signals.py)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------------------------------------- the quick check


def pytest_addoption(parser):
    parser.addoption(
        "--quick", action="store_true",
        help="the developer's quick check (README, Development): every test file collected from the checkout's root, "
             "the first case of each test, and no test marked slow")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of the quick check (--quick); the full run and CI keep it")


def pytest_collection_modifyitems(config, items):
    """Under --quick keep the first parametrized case of each test function, and no test marked slow."""
    if not config.getoption("--quick"):
        return
    kept, dropped, seen = [], [], set()
    for item in items:
        function = item.nodeid.split("[")[0]
        if item.get_closest_marker("slow") is not None or function in seen:
            dropped.append(item)
        else:
            seen.add(function)
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
