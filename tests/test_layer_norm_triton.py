"""Triton LayerNorm / RMSNorm (residual + dropout) against the float64 reference, outputs and every gradient, in each
kernel variant ("row", "rows": ``layer_norm.VARIANTS``, run with ``variants.forced``).

Runs on CUDA when present, else on CPU tensors under the Triton interpreter (set up in conftest.py).
"""
import pytest
import torch

from fused_transformer import backend, functional, reference
from fused_transformer.ops import layer_norm as norm_op
from fused_transformer.kernels import layer_norm as triton_layer_norm
from fused_transformer.kernels import variants
from fused_transformer.kernels._common import dropout_keep_mask, interpreting
from fused_transformer.kernels.targets import TARGETS
from tests.kernel_checks import DTYPES, check_against_reference, replayed_keep_mask
from tests.numerics import DEVICE, assert_close_to_reference

pytestmark = pytest.mark.usefixtures("interpreter_rounds_to_nearest", "nan_filled_outputs")

EPS = 1e-5


def _random_inputs(shape, dtype, *, weight=True, bias=True, residual=False, param_dtype=None):
    n = shape[-1]
    param_dtype = param_dtype or dtype
    return {
        "x": torch.randn(shape, device=DEVICE, dtype=dtype),
        "weight": 1.0 + 0.5 * torch.randn(n, device=DEVICE, dtype=param_dtype) if weight else None,
        "bias": torch.randn(n, device=DEVICE, dtype=param_dtype) if bias else None,
        "residual": torch.randn(shape, device=DEVICE, dtype=dtype) if residual else None,
    }


def _replayed_keep_mask(torch_seed, x, dropout_p):
    """The keep-mask the kernel drew after ``torch.manual_seed(torch_seed)``, shaped like x."""
    n = x.shape[-1]
    return replayed_keep_mask(torch_seed, x.numel() // n, n, dropout_p, x.device).reshape(x.shape)


def _forced(kernel_variant):
    """Run the forward and the backward in ``kernel_variant`` whatever the measured rows say."""
    return variants.forced({triton_layer_norm.FWD: kernel_variant, triton_layer_norm.BWD: kernel_variant})


KERNEL_VARIANTS = triton_layer_norm.VARIANTS

VARIANTS = {
    # name: (residual, prenorm, dropout_p, weight, bias)
    "affine": (False, False, 0.0, True, True),
    "no_affine": (False, False, 0.0, False, False),
    "weight_only_prenorm": (False, True, 0.0, True, False),
    "residual_prenorm": (True, True, 0.0, True, True),
    "residual_dropout": (True, False, 0.3, True, True),
    "residual_dropout_prenorm": (True, True, 0.3, False, True),
}


@pytest.mark.parametrize("kernel_variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("hidden", [1, 13, 768])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_reference(dtype, hidden, variant, kernel_variant):
    """37 rows: "rows" takes 16 (hidden 1, 13) or 4 (768) a tile, forward and backward, the last tile part empty."""
    residual, prenorm, dropout_p, weight, bias = VARIANTS[variant]
    torch.manual_seed(hidden)
    inputs = _random_inputs((37, hidden), dtype, weight=weight, bias=bias, residual=residual)
    keep = _replayed_keep_mask(7, inputs["x"], dropout_p) if dropout_p > 0 else None
    out_grads = [torch.randn_like(inputs["x"]) for _ in range(2)]

    def kernel_fn(x, weight, bias, residual):  # the kernel entry: the kernels even where ATen runs the op
        torch.manual_seed(7)
        return triton_layer_norm.layer_norm(x, weight, bias, EPS, residual=residual, dropout_p=dropout_p,
                                            prenorm=prenorm)

    def reference_fn(x, weight, bias, residual):
        return reference.layer_norm(
            x, weight, bias, EPS, residual=residual, dropout_p=dropout_p, prenorm=prenorm, keep_mask=keep
        )

    with _forced(kernel_variant):
        check_against_reference(kernel_fn, reference_fn, inputs, out_grads)


def test_a_named_backend_runs_the_kernels_and_torchs_path_is_torch_nn(monkeypatch):
    """``use_backend("triton")`` runs the kernels on every call, without dropout too (the route sends those to ATen
    only on "auto", tests/test_route.py); torch's path (``"torch"``) is ATen's add + F.layer_norm, torch.nn's values
    bit for bit."""
    launched, launch = [], triton_layer_norm.launch_kernel

    def spy(kernel, *args, **kwargs):
        if kernel is triton_layer_norm._layer_norm_fwd_kernel:
            launched.append(args)
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(triton_layer_norm, "launch_kernel", spy)
    inputs = _random_inputs((2, 5, 24), torch.bfloat16, weight=True, bias=True, residual=True)
    x, weight, bias, residual = (inputs[name] for name in ("x", "weight", "bias", "residual"))
    with backend.use_backend("triton"):
        functional.layer_norm(x, weight, bias, EPS, residual=residual, prenorm=True)
        functional.layer_norm(x, weight, None, EPS)
        functional.layer_norm(x, weight.float(), bias, EPS)
        triton_layer_norm.layer_norm(x, weight, bias, EPS, rms_norm=True)
    assert len(launched) == 4
    spec = norm_op.check(x, weight, bias, EPS, residual, 0.0, True)
    y, z = norm_op.run("torch", x, weight, bias, residual, spec)
    assert len(launched) == 4
    torch.testing.assert_close(z, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x + residual, (24,), weight, bias, EPS), rtol=0,
                               atol=0)


@pytest.mark.parametrize(
    "shape, dtype, param_dtype, kernel_variant",
    [
        ((1, 1000), torch.float32, torch.float32, "row"),
        ((2, 3, 1000), torch.bfloat16, torch.float32, "row"),  # leading dims, float32 params with bfloat16 x
        ((2, 3, 1000), torch.bfloat16, torch.float32, "rows"),  # the same, 4 rows a tile
        ((3, 16384), torch.float32, torch.float32, "row"),  # the largest hidden size
        ((2, 5000), torch.float16, torch.float16, "row"),
    ],
)
def test_layer_norm_shapes_and_mixed_dtypes(shape, dtype, param_dtype, kernel_variant):
    torch.manual_seed(len(shape))
    inputs = _random_inputs(shape, dtype, residual=True, param_dtype=param_dtype)
    out_grads = [torch.randn_like(inputs["x"]) for _ in range(2)]

    def kernel_fn(x, weight, bias, residual):
        return triton_layer_norm.layer_norm(x, weight, bias, EPS, residual=residual, prenorm=True)

    def reference_fn(x, weight, bias, residual):
        return reference.layer_norm(x, weight, bias, EPS, residual=residual, prenorm=True)

    with _forced(kernel_variant):
        check_against_reference(kernel_fn, reference_fn, inputs, out_grads)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_weight_and_bias_gradients_share_one_reduction(monkeypatch, bias_dtype):
    """The backward's partial sums of dweight and dbias lie side by side; one dtype takes one ``sum_rows`` launch for
    both, bit-identical to a launch each (each column sums the same partials in the same order), which mixed dtypes
    and the custom op (whose outputs may not alias) keep."""
    torch.manual_seed(3)
    x, dy = (torch.randn(37, 48, device=DEVICE) for _ in range(2))
    weight, bias = torch.randn(48, device=DEVICE), torch.randn(48, device=DEVICE, dtype=bias_dtype)
    _, _, mean, rstd = triton_layer_norm.layer_norm_fwd(x, weight, bias, None, EPS, 0.0, None, False, False)
    sums, sum_rows = [], triton_layer_norm.sum_rows
    monkeypatch.setattr(triton_layer_norm, "sum_rows",
                        lambda t, dtype, **parts: sums.append(t.shape[1]) or sum_rows(t, dtype, **parts))
    args = (dy, None, x, weight, bias, mean, rstd, 0.0, None, False, False)
    one = triton_layer_norm.layer_norm_bwd(*args)
    assert sums == ([96] if bias_dtype == torch.float32 else [48, 48])
    sums.clear()
    apart = triton_layer_norm.layer_norm_bwd(*args, one_sum=False)
    assert sums == [48, 48]
    assert one[1] is None and apart[1] is None  # no residual: no dresidual
    for a, b in zip(one[::2] + one[3:], apart[::2] + apart[3:]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert one[3].dtype == bias_dtype and one[2].shape == one[3].shape == (48,)


@pytest.mark.parametrize("clusters", [False, True], ids=["split", "cluster"])
@pytest.mark.parametrize("rms_norm", [False, True])
def test_widest_rows_backward(monkeypatch, rms_norm, clusters):
    """Hidden sizes above 8192 run the backward on column blocks (SPLIT_COLS) before sm_90, on whole rows (held by
    a cluster) from sm_90 where the installed Triton builds cluster launches (3.8 on), dropout and prenorm included.
    The interpreter runs either launch (CLUSTERS_UNDER_INTERPRETER); a GPU runs the one its launcher picks."""
    if interpreting():
        monkeypatch.setattr(triton_layer_norm, "CLUSTERS_UNDER_INTERPRETER", clusters)
    elif triton_layer_norm.launches_clusters(torch.device(DEVICE)) != clusters:
        pytest.skip("the backward launches clusters only from sm_90 with Triton >= 3.8 (toolchain.cluster_launches): "
                    f"{'not' if clusters else 'always'} on this GPU with this Triton")
    launches = []
    launch = triton_layer_norm.bwd_launch
    monkeypatch.setattr(triton_layer_norm, "bwd_launch", lambda *args: launches.append(launch(*args)) or launches[-1])
    torch.manual_seed(3)
    inputs = _random_inputs((5, 9000), torch.bfloat16, residual=True)
    keep = _replayed_keep_mask(7, inputs["x"], 0.2)
    out_grads = [torch.randn_like(inputs["x"]) for _ in range(2)]

    def kernel_fn(x, weight, bias, residual):
        torch.manual_seed(7)
        return triton_layer_norm.layer_norm(
            x, weight, bias, EPS, residual=residual, dropout_p=0.2, prenorm=True, rms_norm=rms_norm
        )

    def reference_fn(x, weight, bias, residual):
        z = reference.dropout(x, 0.2, keep) + residual
        if rms_norm:
            return _reference_rms_norm(z, weight, bias, torch.zeros_like(z), EPS)
        return reference.layer_norm(z, weight, bias, EPS, prenorm=True)

    check_against_reference(kernel_fn, reference_fn, inputs, out_grads)
    picked = triton_layer_norm.launches_clusters(inputs["x"].device)  # what the launcher asks, here and on a GPU
    assert picked == clusters
    assert launches and all((launch.col_blocks == 1) == picked and (launch.num_ctas > 1) == picked
                            for launch in launches), launches


@pytest.mark.parametrize("kernel_variant", KERNEL_VARIANTS)
def test_layer_norm_strided_rows(kernel_variant):
    torch.manual_seed(0)
    storage = torch.randn(37, 80, device=DEVICE, dtype=torch.float32)
    x = storage[:, 3:67]  # rows 80 apart, last dim contiguous: no copy needed
    weight, bias = torch.randn(64, device=DEVICE), torch.randn(64, device=DEVICE)
    expected = reference.layer_norm(x.double(), weight.double(), bias.double(), EPS)
    baseline = reference.layer_norm(x, weight, bias, EPS)
    with _forced(kernel_variant):
        assert_close_to_reference(triton_layer_norm.layer_norm(x, weight, bias, EPS), expected, baseline)


def test_the_variants_are_registered_with_row_as_the_default():
    for op in (triton_layer_norm.FWD, triton_layer_norm.BWD):
        assert variants.registered()[op] == ("row", {"row": "", "rows": ""})


def test_forcing_an_unknown_variant_raises():
    with pytest.raises(ValueError, match="no variant 'columns'"):
        with variants.forced({triton_layer_norm.FWD: "columns"}):
            pass


def test_shape_classes():
    shape_class = triton_layer_norm.shape_class
    assert shape_class(1024, 16384, torch.bfloat16) == "bf16/N1024/R<64k"
    assert shape_class(1000, 4095, torch.float16) == "fp16/N1024/R<4k"
    assert shape_class(1, 65536, torch.float32) == "fp32/N16/R64k+"


def _spy_block_m(monkeypatch):
    """(forward or backward, BLOCK_M, grid) of every LayerNorm kernel launch from here on."""
    launched, launch = [], triton_layer_norm.launch_kernel

    def spy(kernel, grid, args, *options, **constexprs):
        if kernel in (triton_layer_norm._layer_norm_fwd_kernel, triton_layer_norm._layer_norm_bwd_kernel):
            fwd = kernel is triton_layer_norm._layer_norm_fwd_kernel
            named = {**dict(zip(kernel.arg_names, args)), **constexprs}  # the constexprs by position or by name
            launched.append(("fwd" if fwd else "bwd", named["BLOCK_M"], grid))
        return launch(kernel, grid, args, *options, **constexprs)

    monkeypatch.setattr(triton_layer_norm, "launch_kernel", spy)
    return launched


@pytest.mark.parametrize("kernel_variant", KERNEL_VARIANTS)
def test_the_launchers_run_the_forced_variant(monkeypatch, kernel_variant):
    """37 rows of 13 columns: "rows" normalises 16 a program (3 programs, the last with 5) and the backward's programs
    step 16 rows at a time over a multiple of 16 rows each; "row" one row a program."""
    launched = _spy_block_m(monkeypatch)
    x = torch.randn(37, 13, device=DEVICE, requires_grad=True)
    with _forced(kernel_variant):
        triton_layer_norm.layer_norm(x, None, None, EPS, dropout_p=0.2).sum().backward()
    block_m = 16 if kernel_variant == "rows" else 1
    rows_per_program = triton_layer_norm.backward_rows_per_program(37, x.device, block_m)
    assert launched == [("fwd", block_m, (-(-37 // block_m),)), ("bwd", block_m, (-(-37 // rows_per_program), 1))]
    assert rows_per_program % block_m == 0


@pytest.fixture
def rows_file(tmp_path, monkeypatch):
    """An empty variants file standing for the package's measured rows."""
    monkeypatch.setattr(variants, "MEASURED_FILE", str(tmp_path / "variant_rows.json"))
    variants.forget_rows()
    yield
    variants.forget_rows()


def test_a_measured_row_picks_the_variant_of_its_gpu_and_shape_class(monkeypatch, rows_file):
    x, wider = torch.randn(37, 13, device=DEVICE), torch.randn(37, 100, device=DEVICE)
    shape = triton_layer_norm.shape_class(13, 37, x.dtype)
    variants.write_rows([variants.VariantRow(triton_layer_norm.FWD, variants.gpu_name(x.device), shape, "rows", 0.8,
                                             1.5, "F.layer_norm", "test")])
    launched = _spy_block_m(monkeypatch)
    for t in (x, wider):  # the second is of another class (N128): the default runs
        triton_layer_norm.layer_norm_fwd(t, None, None, None, EPS, 0.0, None, False, False)
    assert [block_m for _, block_m, _ in launched] == [16, 1]


def test_the_variants_draw_the_same_dropout_mask():
    """Element (row, col) keeps dropout_keep(seed, row * N + col) in either variant: z = dropout(x) + residual is
    bitwise the same, and dx is zero at the same elements."""
    torch.manual_seed(0)
    x, residual, dy = (torch.randn(37, 100, device=DEVICE) for _ in range(3))
    weight, bias = torch.randn(100, device=DEVICE), torch.randn(100, device=DEVICE)
    results = []
    for kernel_variant in KERNEL_VARIANTS:
        x_v = x.clone().requires_grad_()
        with _forced(kernel_variant):
            torch.manual_seed(7)
            y, z = triton_layer_norm.layer_norm(x_v, weight, bias, EPS, residual=residual, dropout_p=0.5,
                                                prenorm=True)
            (y * dy).sum().backward()
        results.append((y.detach(), z.detach(), x_v.grad))
    (y_row, z_row, dx_row), (y_rows, z_rows, dx_rows) = results
    assert torch.equal(z_row, z_rows)
    torch.testing.assert_close(y_row, y_rows)  # the same math; the sums' order may differ on a GPU
    assert torch.equal(dx_row == 0, dx_rows == 0) and 0.4 < (dx_row == 0).float().mean().item() < 0.6


def test_the_aot_configs_hold_every_launch_of_every_variant():
    """What ``python -m fused_transformer report`` compiles: each variant's launch for each row width and target,
    "rows" as configs of their own (".../rows") where its tile holds more than one row."""
    configs = triton_layer_norm.aot_configs()
    fwd = {(k.constexprs["BLOCK_M"], k.constexprs["BLOCK_N"], k.num_warps): k.config
           for k in configs if k.name == "layer_norm_fwd"}
    bwd = {(k.constexprs["BLOCK_M"], k.constexprs["BLOCK_N"], k.constexprs["SPLIT_COLS"], k.num_warps, k.num_ctas,
            target): k.config for k in configs if k.name == "layer_norm_bwd" for target in k.targets}
    for n_cols in (1, 13, 100, 1000, 1024, 2049, 4096, 8193, 16384):
        for kernel_variant in KERNEL_VARIANTS:
            launch = triton_layer_norm.fwd_launch(n_cols, kernel_variant)
            config = fwd[(launch.block_m, launch.block_n, launch.num_warps)]
            assert config.endswith("/rows") == (launch.block_m > 1), (n_cols, config)
            for target in TARGETS:
                launch = triton_layer_norm.bwd_launch(n_cols, triton_layer_norm.clusters_on(target), kernel_variant)
                config = bwd[(launch.block_m, launch.block_n, launch.col_blocks > 1, launch.num_warps, launch.num_ctas,
                              target.capability)]
                assert config.endswith("/rows") == (launch.block_m > 1), (n_cols, config)
    rows = triton_layer_norm.fwd_launch(1000, "rows")
    assert (rows.block_m, rows.block_n, rows.num_warps) == (4, 1024, 8)
    assert triton_layer_norm.fwd_launch(4096, "rows") == triton_layer_norm.fwd_launch(4096, "row")
    assert triton_layer_norm.bwd_launch(8193, False, "rows") == triton_layer_norm.bwd_launch(8193, False, "row")


def _reference_rms_norm(x, weight, bias, residual, eps):
    z = x + residual
    zs = z.to(reference.stats_dtype(z.dtype))
    y = zs * torch.rsqrt(zs.square().mean(dim=-1, keepdim=True) + eps) * weight.to(zs.dtype) + bias.to(zs.dtype)
    return y.to(x.dtype), z


@pytest.mark.parametrize("kernel_variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("hidden", [13, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype, hidden, kernel_variant):
    torch.manual_seed(hidden)
    inputs = _random_inputs((37, hidden), dtype, residual=True)
    out_grads = [torch.randn_like(inputs["x"]) for _ in range(2)]

    def kernel_fn(x, weight, bias, residual):
        return triton_layer_norm.layer_norm(x, weight, bias, EPS, residual=residual, prenorm=True, rms_norm=True)

    def reference_fn(x, weight, bias, residual):
        return _reference_rms_norm(x, weight, bias, residual, EPS)

    with _forced(kernel_variant):
        check_against_reference(kernel_fn, reference_fn, inputs, out_grads)


def test_dropout_is_reproducible_from_torch_seed():
    x = torch.randn(37, 100, device=DEVICE)

    def run(seed):
        torch.manual_seed(seed)
        return triton_layer_norm.layer_norm(x, None, None, EPS, dropout_p=0.5)

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))
    keep = _replayed_keep_mask(1, x, 0.5)
    assert 0.4 < keep.float().mean().item() < 0.6


def _correlation(a, b):
    return torch.corrcoef(torch.stack([a.reshape(-1), b.reshape(-1)]).float())[0, 1].abs().item()


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_the_dropout_stream_keeps_one_minus_p_with_neighbours_untied(dropout_p):
    """The per-element stream (``_common.dropout_keep``, which LayerNorm and attention draw: a Philox call of
    ``PHILOX_ROUNDS`` rounds per element) keeps 1 - p of the elements, and no neighbour is tied to another: not
    the next column, the next row, nor the same element under the next seed; four neighbours are all kept as often
    as (1 - p)^4 says."""
    n = 256  # 65536 elements: the keep rate's standard deviation is at most 0.002, a correlation's about 0.004
    first, second = (dropout_keep_mask(torch.tensor([seed]), n, n, dropout_p, DEVICE).float() for seed in (7, 8))
    assert abs(first.mean().item() - (1 - dropout_p)) < 0.01
    assert _correlation(first[:, 1:], first[:, :-1]) < 0.02
    assert _correlation(first[1:], first[:-1]) < 0.02
    assert _correlation(first, second) < 0.02
    all_four = (first[:-1, :-1] * first[:-1, 1:] * first[1:, :-1] * first[1:, 1:]).mean().item()
    assert abs(all_four - (1 - dropout_p) ** 4) < 0.01


def test_float64_is_rejected():
    x = torch.randn(4, 8, device=DEVICE, dtype=torch.float64)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        with backend.use_backend("triton"):
            functional.layer_norm(x, None, None)


def test_hidden_size_above_limit_is_rejected():
    x = torch.randn(1, triton_layer_norm.MAX_HIDDEN + 1, device=DEVICE)
    with pytest.raises(ValueError, match="hidden sizes up to"):
        triton_layer_norm.layer_norm(x, None, None)


def test_custom_ops_pass_opcheck():
    torch.manual_seed(0)
    x, residual = torch.randn(5, 24, device=DEVICE), torch.randn(5, 24, device=DEVICE)
    weight, bias = torch.randn(24, device=DEVICE), torch.randn(24, device=DEVICE)
    seed = torch.tensor([123], device=DEVICE)
    args = (x, weight, bias, residual, EPS, 0.1, seed, False, True)
    torch.library.opcheck(torch.ops.fused_transformer.layer_norm_fwd, args)
    y, z, mean, rstd = torch.ops.fused_transformer.layer_norm_fwd(*args)
    torch.library.opcheck(
        torch.ops.fused_transformer.layer_norm_bwd,
        (torch.randn_like(y), None, z, weight, bias, mean, rstd, 0.1, seed, False, True),
    )


def _bwd_bytes_per_element(n_rows, n_cols, itemsize, *, clusters, has_dz=False, has_residual=False, parameters=2):
    """Global bytes the backward kernel loads and stores per element of z on a GPU, from the launcher's picks:
    dy and z once per column block of the row, dx (plus dz, dresidual), and the float32 partial rows of the
    ``parameters`` (dweight, dbias) each program writes. Weight and bias reads (one [N] vector shared by every row)
    and the per-row mean / rstd are left out."""
    cuda = torch.device("cuda", 0)
    reads = triton_layer_norm.bwd_launch(n_cols, clusters).col_blocks
    programs = -(-n_rows // triton_layer_norm.backward_rows_per_program(n_rows, cuda))
    row_bytes = itemsize * (2 * reads + 1 + has_dz + has_residual)
    return row_bytes + 4 * parameters * programs / n_rows


@pytest.mark.parametrize("sms", [1, 108, 132])
def test_backward_bytes_per_element(monkeypatch, sms):
    """Whole rows read dy and z once (up to 8192 columns everywhere, up to 16384 on a cluster from sm_90); the partial
    sums add at most 1 byte per element (plus 8 / rows for the last, partly filled program; fewer rows than
    MIN_ROWS_PER_PROGRAM share one program)."""
    monkeypatch.setattr(triton_layer_norm, "backward_programs", lambda device: 4 * sms)
    for n_rows in (8, 100, 4096, 4097, 100_000):
        last_program = 8 / n_rows
        for clusters in (False, True):
            for n_cols in (1, 1000, 1024, 4096, 8191, 8192) + ((8193, 12288, 16384) if clusters else ()):
                assert _bwd_bytes_per_element(n_rows, n_cols, 2, clusters=clusters) <= 7 + last_program
                assert _bwd_bytes_per_element(n_rows, n_cols, 4, clusters=clusters) <= 13 + last_program
        for n_cols in (8193, 12288, 16384):  # split rows before sm_90: two 8192-column programs read dy and z twice
            assert _bwd_bytes_per_element(n_rows, n_cols, 2, clusters=False) <= 2 * (2 * 2 + 1) + 1 + last_program
