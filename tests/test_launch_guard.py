"""The guard on ``launch_kernel``'s direct call (kernels/_common.py): a compiled kernel whose launcher or fields do not
fit the call Triton's own ``JITFunction.run`` makes is refused at its first use, its kernel then launches through
``run`` for good; ``FUSED_TRANSFORMER_DIRECT_LAUNCH=0`` (or ``set_direct_launch(False)``) sends every launch there."""
import warnings
from types import SimpleNamespace

import pytest
import torch
import triton

from fused_transformer.kernels import _common
from fused_transformer.tools import gpu_check_parts
from tests.numerics import DEVICE
from tests.test_backend import run_python


class _Compiled:
    """A compiled kernel with the fields the direct call reads and Triton 3.7-3.9's launcher; records its launches."""

    function, packed_metadata = 11, (4, 1, 0)

    def __init__(self):
        self.launches = []

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)

    def run(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
            launch_exit_hook, *args):
        self.launches.append((gridX, gridY, gridZ, stream, function, kernel_metadata, *args))


class _Compiled36(_Compiled):
    """Triton 3.6's launcher: the metadata and the hooks come in ``*args``."""

    def run(self, gridX, gridY, gridZ, stream, function, *args):
        self.launches.append((gridX, gridY, gridZ, stream, function, *args[:1], *args[4:]))


class _Inserted(_Compiled):
    """A release that puts a parameter of its own among the ones the direct call fills by position."""

    def run(self, gridX, gridY, gridZ, stream, function, cluster_dims, kernel_metadata, launch_metadata,
            launch_enter_hook, launch_exit_hook, *args):
        raise AssertionError("a launcher the guard refused was called")


class _Renamed(_Compiled):
    def run(self, grid_x, grid_y, grid_z, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
            launch_exit_hook, *args):
        raise AssertionError("a launcher the guard refused was called")


class _NoVarArgs(_Compiled):
    def run(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
            launch_exit_hook, args):
        raise AssertionError("a launcher the guard refused was called")


class _KeywordOnly(_Compiled):
    def run(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
            launch_exit_hook, *args, profile_scratch):
        raise AssertionError("a launcher the guard refused was called")


class _NoFunction(_Compiled):
    function = None  # as a CompiledKernel whose handles were never loaded


class _NoPackedMetadata(_Compiled):
    packed_metadata = property(lambda self: None)


class _Kernel:
    """A JITFunction's parts that launch_kernel reads, (X, n, BLOCK: constexpr); its run compiles ``compiled``."""

    arg_names = ["X", "n", "BLOCK"]
    params = [SimpleNamespace(is_constexpr=name == "BLOCK") for name in arg_names]

    def __init__(self, compiled: type, name: str = "stand_in_kernel"):
        self.compiled, self.runs, self.__name__ = compiled, [], name

    def run(self, *args, grid, warmup, **options):
        self.runs.append((args, grid))
        return self.compiled()


@pytest.fixture
def on_a_gpu(monkeypatch):
    """launch_kernel as on a GPU, with fresh caches and the direct launch on."""
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(_common, "current_device", lambda: 0)
    monkeypatch.setattr(_common, "current_stream", lambda device: 7)
    for cache in ("_COMPILED", "_RUNTIME_PARAMS", "_REFUSED"):
        monkeypatch.setattr(_common, cache, {})
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    previous = _common.set_direct_launch(True)
    yield
    _common.set_direct_launch(previous)


def _launch(kernel: _Kernel, x: torch.Tensor, n: int = 16) -> None:
    _common.launch_kernel(kernel, (3,), (x, n), 4, BLOCK=64)


@pytest.mark.parametrize("version", ["3.7.1", "3.8.0", "3.9.0", "3.10.0+git1234"])
def test_the_launcher_of_the_release_fits(version):
    assert _common.direct_launch_mismatch(_Compiled(), version) is None
    why = _common.direct_launch_mismatch(_Compiled36(), version)
    assert "(gridX, gridY, gridZ, stream, function, *args)" in why and version in why


def test_triton_3_6s_launcher_fits_3_6_only():
    assert _common.direct_launch_mismatch(_Compiled36(), "3.6.0") is None
    assert "launch_exit_hook" in _common.direct_launch_mismatch(_Compiled(), "3.6.0")


@pytest.mark.parametrize("compiled, says", [
    (_Inserted, "cluster_dims"), (_Renamed, "grid_x"), (_NoVarArgs, "launch_exit_hook, args)"),
    (_KeywordOnly, "profile_scratch"), (_NoFunction, "no function"), (_NoPackedMetadata, "no packed_metadata"),
])
def test_a_changed_launcher_or_a_missing_field_is_refused(compiled, says):
    why = _common.direct_launch_mismatch(compiled(), "3.9.0")
    assert why is not None and says in why, why


def test_the_installed_tritons_own_launchers_fit():
    """Triton's launcher classes as the installed release builds them (a new release that changes them fails here,
    as it would send every launch through run on a GPU: LAUNCHER_SIGNATURES wants its layout, once checked)."""
    from triton.backends.amd.driver import HIPLauncher
    from triton.backends.nvidia.driver import CudaLauncher

    for launcher in (CudaLauncher, HIPLauncher):
        compiled = SimpleNamespace(run=object.__new__(launcher), function=11, packed_metadata=(4, 1, 0))
        assert _common.direct_launch_mismatch(compiled) is None, launcher


def test_a_fitting_kernel_launches_directly_after_its_first_launch(on_a_gpu):
    kernel, x = _Kernel(_Compiled), torch.randn(64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            _launch(kernel, x)
    assert len(kernel.runs) == 1 and _common.direct_launch_refusals() == {}
    assert len(_common._COMPILED) == 1
    (compiled,) = _common._COMPILED.values()
    assert compiled.launches == [(3, 1, 1, 7, 11, (4, 1, 0), x, 16, 64)] * 2


@pytest.mark.parametrize("compiled", [_Inserted, _NoFunction, _KeywordOnly])
def test_a_refused_kernel_launches_through_run_for_good(on_a_gpu, compiled):
    kernel, x = _Kernel(compiled), torch.randn(64)
    with pytest.warns(RuntimeWarning, match="stand_in_kernel launches through Triton's JITFunction.run"):
        _launch(kernel, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        for n in (16, 32, 16):
            _launch(kernel, x, n)
        kernel.compiled = _Compiled  # a later compilation that would fit: the kernel stays on run
        _launch(kernel, x)
        _common._RUNTIME_PARAMS.clear()  # nor does a cache of the kernel's parameters forget it
        _launch(kernel, x)
    assert len(kernel.runs) == 6 and _common._COMPILED == {}
    assert _common.launch_key(kernel, (x, 16, 64), (0, 4, None, 1)) is None
    assert list(_common.direct_launch_refusals()) == ["stand_in_kernel"]
    assert _common.direct_launch_refusals()["stand_in_kernel"] == _common.direct_launch_mismatch(compiled())
    other = _Kernel(_Compiled, "other_kernel")  # refusals are per kernel
    for _ in range(2):
        _launch(other, x)
    assert len(other.runs) == 1


def test_a_launch_metadata_missing_under_a_profilers_hook_is_refused_at_its_first_use(on_a_gpu, monkeypatch):
    class NoLaunchMetadata(_Compiled):
        launch_metadata = None

    kernel, x = _Kernel(NoLaunchMetadata), torch.randn(64)
    _launch(kernel, x)
    _launch(kernel, x)  # no hook: the direct call passes no metadata
    assert len(kernel.runs) == 1
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", print)
    with pytest.warns(RuntimeWarning, match="no launch_metadata"):
        _launch(kernel, x)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    _launch(kernel, x)
    assert len(kernel.runs) == 3 and "stand_in_kernel" in _common.direct_launch_refusals()


def test_set_direct_launch_off_sends_every_launch_through_run(on_a_gpu):
    kernel, x = _Kernel(_Compiled), torch.randn(64)
    assert _common.set_direct_launch(False) is True
    for _ in range(3):
        _launch(kernel, x)
    assert len(kernel.runs) == 3 and _common._COMPILED == {}
    assert kernel.runs == [((x, 16), (3,))] * 3  # the constexprs by name, as run takes them
    assert _common.set_direct_launch(True) is False
    for _ in range(2):
        _launch(kernel, x)
    assert len(kernel.runs) == 4


@pytest.mark.parametrize("value, direct", [("0", False), ("1", True), (None, True)])
def test_the_environment_variable_is_read_at_import(value, direct):
    done = run_python("from fused_transformer.kernels import _common; print(_common._DIRECT_LAUNCH)",
                      FUSED_TRANSFORMER_DIRECT_LAUNCH=value)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == str(direct)


def test_kernels_launch_through_run_with_the_direct_launch_off():
    """Real kernels, launched with the direct launch off (under the interpreter here, compiled on a GPU), against
    torch."""
    previous = _common.set_direct_launch(False)
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(1500, 77, generator=generator).to(DEVICE)
        torch.testing.assert_close(_common.sum_rows(x, torch.float32), x.sum(0), rtol=1e-5, atol=1e-4)
        keep = _common.dropout_keep_mask(123, 9, 33, 0.25, torch.device(DEVICE))
        assert keep.shape == (9, 33) and 0.5 < keep.float().mean().item() < 0.95
        assert torch.equal(keep, _common.dropout_keep_mask(123, 9, 33, 0.25, torch.device(DEVICE)))
    finally:
        _common.set_direct_launch(previous)


def test_gpu_check_runs_the_kernel_tests_again_with_the_direct_launch_off(tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text("")
    for name in ("test_attention_triton.py", "test_layer_norm_triton.py", "test_modules.py"):
        (tmp_path / "tests" / name).write_text("")
    ran = []

    def fake_run(command, limit_s, log, **options):
        """The first run passes (its junit XML: one test), the one with the direct launch off has a failure."""
        ran.append((command, limit_s, options["env"]))
        if len(ran) == 1:
            junit = command[command.index("--junitxml") + 1]
            with open(junit, "w") as f:
                f.write('<testsuites><testsuite><testcase classname="tests.test_modules" name="test_a"/>'
                        '</testsuite></testsuites>')
            return gpu_check_parts.Finished(0, False, 30.0, ".\n")
        return gpu_check_parts.Finished(1, False, 30.0, "..F.\n")

    monkeypatch.setattr(gpu_check_parts, "run_with_limit", fake_run)
    record = gpu_check_parts.tests_part(str(tmp_path), 200, root=str(tmp_path), workers=0)
    (tests, _, tests_env), (public, public_limit, public_env) = ran
    assert "FUSED_TRANSFORMER_DIRECT_LAUNCH" not in tests_env and public_env["FUSED_TRANSFORMER_DIRECT_LAUNCH"] == "0"
    assert "TRITON_INTERPRET" not in public_env and "--quick" in public
    assert [arg for arg in public if arg.startswith("tests/")] == ["tests/test_attention_triton.py",
                                                                   "tests/test_layer_norm_triton.py"]
    assert public_limit == 200 - 30 - gpu_check_parts.INNER_MARGIN_S
    assert record["status"] == "failed" and "FUSED_TRANSFORMER_DIRECT_LAUNCH=0: 1 failed" in record["reason"]
    ran.clear()
    record = gpu_check_parts.tests_part(str(tmp_path), 80, root=str(tmp_path), workers=0)
    assert len(ran) == 1 and "50 s left" in record["figures"]["public_launch"]["not_run"]
    assert record["status"] == "passed"
