"""The supported Triton range (kernels/toolchain.py): version parsing, the floor the backend enforces, what each
release builds (cluster launches, tile rows), the older interpreter's scalar conversion, and the packaging that
states the floors. .ci/versions runs these under every tested release; the report compiles what they plan."""
import ast
import os
import sys

import pytest
import torch
import triton
import triton.language as tl

from fused_transformer import backend
from fused_transformer.kernels import layer_norm, toolchain
from fused_transformer.kernels.attention import TILE_ROWS, aot, configs
from fused_transformer.kernels.targets import BY_CAPABILITY, TARGETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_versions_parse_to_major_minor():
    assert toolchain.parse("3.7.1") == (3, 7)
    assert toolchain.parse("3.10.0+git1a2b3c") == (3, 10)
    assert toolchain.parse("3.6.0rc1") == (3, 6)
    with pytest.raises(ValueError, match="triton version 'nightly'"):
        toolchain.parse("nightly")


def test_the_floor_is_stated_once_and_enforced():
    assert toolchain.unsupported_reason("3.6.0") is None
    assert toolchain.unsupported_reason("3.12.0") is None  # newer than tested: supported, on the newest rows
    reason = toolchain.unsupported_reason("3.5.1")
    assert "triton 3.5.1 is older than 3.6" in reason and "pip install 'triton>=3.6'" in reason
    assert min(toolchain.TESTED) == toolchain.OLDEST


def test_an_older_triton_makes_the_triton_backend_unavailable(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    backend.triton_unavailable_reason.cache_clear()
    try:
        assert "older than 3.6" in backend.triton_unavailable_reason()
        with backend.use_backend("triton"), pytest.raises(RuntimeError, match="triton 3.5.1 is older than 3.6"):
            backend.current("cuda")
    finally:
        monkeypatch.undo()
        backend.triton_unavailable_reason.cache_clear()
    assert backend.triton_unavailable_reason() is None


def test_a_checkout_not_installed_names_the_interpreter_and_the_fix(monkeypatch):
    """kernels/ joins the package at install time: run in place from a checkout, the package lacks it, and the
    Triton backend says which python imported what, and how to install it there."""
    class NoKernels:  # finds no fused_transformer.kernels, as a checkout's path holds none
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "fused_transformer.kernels":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    for name in ("fused_transformer.kernels.toolchain", "fused_transformer.kernels"):
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [NoKernels, *sys.meta_path])
    backend.triton_unavailable_reason.cache_clear()
    try:
        with pytest.raises(ImportError, match="fused_transformer.kernels is missing") as raised:
            backend.triton_unavailable_reason()
        message = str(raised.value)
        assert sys.executable in message and "-m pip install -e ." in message
    finally:
        monkeypatch.undo()
        backend.triton_unavailable_reason.cache_clear()
    assert backend.triton_unavailable_reason() is None


def test_version_ranges():
    assert (3, 6) in toolchain.EVERY_RELEASE and (3, 12) in toolchain.EVERY_RELEASE
    assert (3, 5) not in toolchain.EVERY_RELEASE
    assert [v in toolchain.BEFORE_3_9 for v in sorted(toolchain.TESTED)] == [True, True, True, False]
    assert str(toolchain.BEFORE_3_9) == "triton 3.6-3.8" and str(toolchain.EVERY_RELEASE) == "triton >= 3.6"


def test_layer_norm_clusters_only_where_the_triton_builds_them():
    hopper, ampere = BY_CAPABILITY[90], BY_CAPABILITY[80]
    assert layer_norm.clusters_on(hopper, (3, 8)) and not layer_norm.clusters_on(hopper, (3, 7))
    assert not layer_norm.clusters_on(ampere, (3, 9))
    for version in toolchain.TESTED:
        bwd = {k.config: k for k in layer_norm.aot_configs(triton=version) if k.name == "layer_norm_bwd"}
        wide = bwd["BLOCK_N=16384,CTAS=2"] if version >= (3, 8) else bwd["BLOCK_N=8192,SPLIT_COLS"]
        assert 90 in wide.targets, version
        assert all(k.num_ctas == 1 for k in bwd.values()) == (version < (3, 8))


@pytest.mark.parametrize("version", sorted(toolchain.TESTED))
def test_every_attention_row_holds_for_some_release_and_plans_differ_only_by_release_rows(version):
    """Rows of one release range are picked only under it; every launch finds a row under every tested release."""
    rows = [row for row in TILE_ROWS if version in row.tritons]
    assert any(row.tritons is toolchain.EVERY_RELEASE for row in rows)
    for row in TILE_ROWS:
        if version not in row.tritons:
            assert not any(row is configs.find_row(row.kernel, row.precision, d, t, row.loads == "tma", row.scores_only,
                                                   layout == "packed", version)
                           for d in row.head_dims for t in row.targets for layout in row.layouts)


def test_release_rows_come_before_the_rows_they_replace():
    """A row for older releases only is followed, under the newest, by a row serving at least its launches (tf32
    launches fall back to the float32 rows, softcap / ALiBi launches to the general ones)."""
    for index, row in enumerate(TILE_ROWS):
        if row.tritons.last is None:
            continue
        later = TILE_ROWS[index + 1:]
        precisions = (row.precision, "fp32") if row.precision == "tf32" else (row.precision,)
        assert any(other.tritons.last is None and other.kernel == row.kernel and other.precision in precisions
                   and set(row.head_dims) <= set(other.head_dims) and set(row.targets) <= set(other.targets)
                   and (row.score_mods or not other.score_mods) for other in later), row


@pytest.mark.parametrize("version", sorted(toolchain.TESTED))
def test_the_report_under_each_release_compiles_its_plans(version):
    """What the report compiles under a release is what the launchers plan under it: a tile that spills under that
    release's allocator is never both planned there and left out of its report."""
    listed = {(k.config, t) for k in aot.aot_configs(triton=version) for t in k.targets}
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        for precision in ("bf16", "fp32", "tf32"):
            for head_dim in (16, 64, 128):
                for target in TARGETS:
                    for scores_only, packed in ((False, False), (False, True)):
                        p = configs.plan(kernel, torch.float32 if precision != "bf16" else torch.bfloat16, head_dim,
                                         target, allow_tf32=precision == "tf32", scores_only=scores_only, packed=packed,
                                         triton=version)
                        name = aot.config_name(precision, head_dim, p.tile, "/varlen" if packed else "", p.use_tma)
                        assert (name, target.capability) in listed, (version, name, target.name)


# -------------------------------------------------------------------------------------------- the interpreter


@triton.jit
def _loop_bounds_from_memory_kernel(OUT, BOUNDS, BLOCK: tl.constexpr):
    start = tl.load(BOUNDS)
    end = tl.minimum(tl.load(BOUNDS + 1), tl.program_id(0) * BLOCK + 100)
    for i in tl.range(start, end, 1, num_stages=1):
        tl.store(OUT + i, 1.0)
    for i in range(start, end):
        tl.store(OUT + i, tl.load(OUT + i) + 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where no GPU does")
def test_loops_bounded_by_loaded_scalars_run_under_the_interpreter():
    """Before Triton 3.7 the interpreter's scalars are one-element arrays that NumPy 2.4 will not turn into an int:
    without toolchain.patch_interpreter every such loop in our kernels failed there."""
    out = torch.zeros(8)
    _loop_bounds_from_memory_kernel[(1,)](out, torch.tensor([2, 6], dtype=torch.int32), BLOCK=4)
    assert out.tolist() == [0, 0, 2, 2, 2, 2, 0, 0]


def test_the_interpreter_patch_applies_to_older_releases_only(monkeypatch):
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        pytest.skip("this Triton's interpreter has no _patch_lang_tensor")
    monkeypatch.setattr(toolchain, "installed", lambda: (3, 9))
    toolchain.patch_interpreter()
    assert interpreter._patch_lang_tensor is original
    monkeypatch.setattr(toolchain, "installed", lambda: (3, 6))
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", lambda tensor, scope: None)
    toolchain.patch_interpreter()
    patched = interpreter._patch_lang_tensor
    assert patched.squeezes_scalars
    toolchain.patch_interpreter()  # idempotent
    assert interpreter._patch_lang_tensor is patched

    class Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    class Handle:
        data = __import__("numpy").array([5])

    class Tensor:
        handle = Handle()

    patched(Tensor, Scope())
    assert Tensor().__index__() == 5


# ---------------------------------------------------------------------------------------------- packaging


def _setup_assignments() -> dict:
    """The module-level assignments of setup.py, evaluated in the tree (setup() itself is not run)."""
    from setuptools import find_packages

    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    assignments = [node for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                   and node.targets[0].id.isupper()]
    names = {"find_packages": lambda where: find_packages(os.path.join(ROOT, where))}
    exec(compile(ast.Module(body=assignments, type_ignores=[]), "setup.py", "exec"), names)
    return names


def test_setup_states_the_tested_floors():
    names = _setup_assignments()
    oldest = f"{toolchain.OLDEST[0]}.{toolchain.OLDEST[1]}"
    assert names["TRITON_FLOOR"] == f"triton>={oldest}"
    assert names["TORCH_FLOOR"] == "torch>=" + toolchain.TESTED[toolchain.OLDEST].split()[1]


def test_setup_ships_every_package():
    """A normal (not editable) install gets every package of the tree, subpackages included."""
    on_disk = {os.path.relpath(folder, ROOT).replace(os.sep, ".").replace("kernels", "fused_transformer.kernels", 1)
               for top in ("fused_transformer", "kernels") for folder, _, files in os.walk(os.path.join(ROOT, top))
               if "__init__.py" in files}
    assert {"fused_transformer.modules", "fused_transformer.kernels.attention"} <= on_disk
    assert set(_setup_assignments()["PACKAGES"]) == on_disk
