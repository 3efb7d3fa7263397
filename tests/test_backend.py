"""The backend switch: one place, three ways to choose, clear errors where a choice cannot run."""
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

import fused_transformer as ft
from fused_transformer import backend


def run_python(code: str, **env_changes: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in env_changes}
    env.update({k: v for k, v in env_changes.items() if v is not None})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120)


def test_auto_resolves_by_device_and_dtype():
    assert backend.get_backend() == "auto"
    expected_cpu = "cpu" if backend.cpu_unavailable_reason() is None else "reference"
    assert ft.current() == expected_cpu
    assert ft.current("cpu", torch.float64) == "reference"
    assert ft.current("cuda") == ("triton" if backend.triton_unavailable_reason() is None else "reference")


def test_context_manager_overrides_and_restores():
    ft.set_backend("reference")
    with ft.use_backend("triton"):
        assert backend.get_backend() == "triton"
        with ft.use_backend("reference"):
            assert ft.current() == "reference"
        assert backend.get_backend() == "triton"
    assert backend.get_backend() == "reference"


def test_overlapping_blocks_in_threads_restore_the_global_choice():
    """Thread A enters use_backend("reference"), thread B use_backend("cpu"), A exits, then B: nothing of either block
    is left, and set_backend takes effect."""
    ft.set_backend("auto")
    a_entered, b_entered, a_exited = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with ft.use_backend("reference"):
            a_entered.set()
            b_entered.wait(10)
        a_exited.set()

    def thread_b():
        a_entered.wait(10)
        with ft.use_backend("cpu"):
            b_entered.set()
            a_exited.wait(10)
            seen["after A exited"] = backend.get_backend()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"after A exited": "cpu"}  # B's block is still open
    assert backend.get_backend() == "auto"
    ft.set_backend("reference")
    assert backend.get_backend() == "reference"
    ft.set_backend("auto")
    assert backend.get_backend() == "auto"


def test_unknown_backend_names_are_rejected():
    with pytest.raises(ValueError, match="backend='cuda' is not a backend; expected one of auto, triton, cpu, reference"):
        ft.set_backend("cuda")
    with pytest.raises(ValueError, match="backend='fast'"):
        with ft.use_backend("fast"):
            pass


def test_environment_variable_chooses_and_is_checked():
    code = "import fused_transformer as ft; print(ft.backend.get_backend(), ft.current())"
    result = run_python(code, FUSED_TRANSFORMER_BACKEND="reference")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["reference", "reference"]
    result = run_python(code, FUSED_TRANSFORMER_BACKEND="gpu")
    assert result.returncode != 0
    assert "FUSED_TRANSFORMER_BACKEND='gpu' is not a backend" in result.stderr


def test_triton_on_cpu_tensors_needs_the_interpreter():
    code = """
        import torch, fused_transformer as ft
        ft.set_backend("triton")
        try:
            ft.attention(*(torch.randn(1, 1, 4, 16) for _ in range(3)))
        except RuntimeError as exc:
            print("ERROR:", exc)
    """
    result = run_python(code, TRITON_INTERPRET=None)
    assert result.returncode == 0, result.stderr
    assert "ERROR: backend 'triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1" in result.stdout


def test_cpu_backend_says_why_it_is_unavailable():
    if backend.cpu_unavailable_reason() is None:
        with pytest.raises(RuntimeError, match="backend 'cpu' got tensors on meta"):
            with ft.use_backend("cpu"):
                ft.current("meta")
        return
    with ft.use_backend("cpu"), pytest.raises(RuntimeError, match="backend 'cpu' is unavailable: the C\\+\\+ extension"):
        ft.attention(*(torch.randn(1, 1, 4, 16) for _ in range(3)))


def test_reference_backend_runs_every_op_on_cpu():
    with ft.use_backend("reference"):
        q = torch.randn(1, 2, 3, 8)
        assert ft.attention(q, q, q).shape == (1, 2, 3, 8)
        assert ft.layer_norm(torch.randn(3, 8), None, None).shape == (3, 8)
        assert ft.feed_forward(torch.randn(3, 8), torch.randn(5, 8), None, torch.randn(8, 5), None).shape == (3, 8)


def test_auto_falls_back_to_the_reference_and_says_why_once(monkeypatch):
    monkeypatch.setattr(backend, "cpu_unavailable_reason", lambda: "the extension did not build (test)")
    backend._auto_cpu_backend.cache_clear()
    with pytest.warns(UserWarning, match="did not build"):
        assert backend.current("cpu", torch.float32) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.current("cpu", torch.float32) == "reference"
    backend._auto_cpu_backend.cache_clear()
