"""Triton attention against the float64 reference: output, LSE and the three gradients, for every mask kind and
combination, odd lengths, head dims, grouped-query heads, dtypes and dropout.

Runs on CUDA when present, else on CPU tensors under the Triton interpreter (set up in conftest.py), which is
slow: shapes stay small, but every one crosses several 32 x 32 interpreter tiles.
"""
import dataclasses

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

import fused_transformer
from fused_transformer import backend, contract, functional, reference
from fused_transformer.kernels import attention as triton_attention
from fused_transformer.kernels._common import draw_dropout_seed, interpreting, launch_kernel, tma_addressable
from fused_transformer.kernels.attention import bwd, configs, fwd, launch
from fused_transformer.kernels.attention import weights as weights_kernel
from fused_transformer.kernels.attention.lengths import padding_lengths
from fused_transformer.kernels.targets import target_of
from tests.numerics import DEVICE, assert_close_to_reference

# The four kernels, where their launchers find them.
KERNELS = [(fwd, "attention_fwd_kernel"), (bwd, "attention_dq_kernel"), (bwd, "attention_dkdv_kernel"),
           (weights_kernel, "attention_weights_kernel")]

pytestmark = pytest.mark.usefixtures("interpreter_rounds_to_nearest", "nan_filled_outputs")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _masks(kind: str, batch: int, heads: int, lq: int, lk: int, generator: torch.Generator) -> dict:
    """Attention keyword arguments for one mask kind, on DEVICE (masks hold at least one visible key per row
    unless the kind is about rows without keys)."""
    def rand(*shape):
        return torch.rand(*shape, generator=generator).to(DEVICE)

    lengths = torch.tensor([lk, max(lk // 2, 1), 1][:batch] + [lk] * max(batch - 3, 0))
    right_padding = (torch.arange(lk)[None, :] >= lengths[:, None]).to(DEVICE)
    if kind == "none":
        return {}
    if kind == "key_padding":
        return {"key_padding_mask": right_padding}
    if kind == "key_padding_scattered":  # not right-padded: the general path
        return {"key_padding_mask": rand(batch, lk) < 0.4}
    if kind == "causal":
        return {"is_causal": True}
    if kind == "causal_bottom_right":
        return {"is_causal": True, "causal_alignment": "bottom_right"}
    if kind == "bool_mask":
        return {"attn_mask": rand(lq, lk) < 0.7}
    if kind == "float_mask":
        return {"attn_mask": torch.randn(batch, 1, lq, lk, generator=generator).to(DEVICE)}
    if kind == "float_mask_with_inf":
        mask = torch.randn(1, heads, lq, 1, generator=generator) * torch.ones(lk)
        return {"attn_mask": mask.masked_fill(torch.rand(1, heads, lq, lk, generator=generator) < 0.3,
                                              float("-inf")).to(DEVICE)}
    if kind == "padding_causal_float_mask":
        return {"key_padding_mask": right_padding, "is_causal": True, "causal_alignment": "bottom_right",
                "attn_mask": torch.randn(lq, lk, generator=generator).to(DEVICE)}
    if kind == "scattered_padding_bool_mask_causal":
        return {"key_padding_mask": rand(batch, lk) < 0.3, "attn_mask": rand(batch, heads, lq, lk) < 0.8,
                "is_causal": True}
    raise ValueError(kind)


MASK_KINDS = (
    "none", "key_padding", "key_padding_scattered", "causal", "causal_bottom_right", "bool_mask", "float_mask",
    "float_mask_with_inf", "padding_causal_float_mask", "scattered_padding_bool_mask_causal",
)


def _random_inputs(batch, heads, kv_heads, lq, lk, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, lq, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, lk, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, lk, head_dim, generator=g, dtype=torch.float64)
    do = torch.randn(batch, heads, lq, head_dim, generator=g, dtype=torch.float64)
    dlse = torch.randn(batch, heads, lq, generator=g, dtype=torch.float64)
    return [t.to(DEVICE) for t in (q, k, v, do, dlse)], g


def _run(fn, q, k, v, do, dlse, dtype, masks, **options):
    """Output, LSE and (dq, dk, dv) of ``fn`` on inputs cast to ``dtype``, backpropagating ``do`` (and ``dlse``
    through the LSE when given)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    masks = {name: (m.to(dtype) if isinstance(m, torch.Tensor) and m.is_floating_point() and dtype == torch.float64
                    else m) for name, m in masks.items()}
    out, lse = fn(q, k, v, return_lse=True, **masks, **options)
    loss = (out * do.to(out.dtype)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * dlse.to(lse.dtype)).sum()
    loss.backward()
    return out, lse, q.grad, k.grad, v.grad


def _check(batch=2, heads=2, kv_heads=2, lq=37, lk=50, head_dim=32, dtype=torch.float32, mask_kind="none",
           seed=0, with_dlse=False):
    (q, k, v, do, dlse), g = _random_inputs(batch, heads, kv_heads, lq, lk, head_dim, seed)
    masks = _masks(mask_kind, batch, heads, lq, lk, g)
    dlse = dlse if with_dlse else None
    got = _run(triton_attention.attention, q, k, v, do, dlse, dtype, masks)
    ref = _run(reference.attention, q, k, v, do, dlse, torch.float64, masks)
    base = _run(reference.attention, q, k, v, do, dlse, dtype, masks)
    ratios = {}
    for name, out, ref64, baseline in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        assert out.shape == baseline.shape and out.dtype == baseline.dtype, name
        ratios[name] = assert_close_to_reference(out, ref64, baseline, f"{name} ({mask_kind}, {dtype})")
    return ratios


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_every_mask_kind_and_dtype_matches_reference(mask_kind, dtype):
    _check(dtype=dtype, mask_kind=mask_kind)


@pytest.mark.parametrize("lq,lk", [(1, 1), (7, 7), (77, 77), (130, 77), (7, 130), (1, 77)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "causal_bottom_right", "padding_causal_float_mask"])
def test_odd_and_unequal_lengths(lq, lk, mask_kind):
    _check(batch=2, heads=1, kv_heads=1, lq=lq, lk=lk, head_dim=16, mask_kind=mask_kind, seed=lq * 1000 + lk)


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
def test_head_dims_including_non_powers_of_two(head_dim):
    _check(batch=1, heads=2, kv_heads=2, lq=40, lk=45, head_dim=head_dim, dtype=torch.float16, mask_kind="causal")


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("mask_kind", ["none", "padding_causal_float_mask"])
def test_grouped_query_attention(kv_heads, mask_kind):
    _check(batch=2, heads=4, kv_heads=kv_heads, lq=33, lk=40, head_dim=16, dtype=torch.bfloat16, mask_kind=mask_kind)


def test_gradient_through_the_returned_lse():
    _check(mask_kind="padding_causal_float_mask", with_dlse=True)


def test_rows_with_no_key_give_zeros_and_zero_gradients():
    batch, heads, lq, lk, dim = 2, 2, 40, 36, 16
    (q, k, v, do, _), _ = _random_inputs(batch, heads, heads, lq, lk, dim, seed=3)
    attn_mask = torch.ones(lq, lk, dtype=torch.bool, device=DEVICE)
    attn_mask[::5] = False  # every 5th query sees nothing
    key_padding_mask = torch.zeros(batch, lk, dtype=torch.bool, device=DEVICE)
    key_padding_mask[1] = True  # the second sequence is all padding
    out, lse, dq, dk, dv = _run(triton_attention.attention, q, k, v, do, None, torch.float32,
                                {"attn_mask": attn_mask, "key_padding_mask": key_padding_mask})
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    no_key = torch.zeros(batch, lq, dtype=torch.bool, device=DEVICE)
    no_key[:, ::5] = True
    no_key[1] = True
    assert (out[no_key.unsqueeze(1).expand(batch, heads, lq)] == 0).all()
    assert (lse[no_key.unsqueeze(1).expand(batch, heads, lq)] == float("-inf")).all()
    assert (dq[no_key.unsqueeze(1).expand(batch, heads, lq)] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (out[0, :, 1] != 0).any()


def test_query_lengths_write_zero_rows():
    (q, k, v, do, _), g = _random_inputs(2, 2, 2, 45, 40, 16, seed=4)
    query_lengths = torch.tensor([45, 20], device=DEVICE)
    out, lse, dq, _, _ = _run(triton_attention.attention, q, k, v, do, None, torch.float32, {},
                              query_lengths=query_lengths)
    ref, base = reference.attention(q, k, v), reference.attention(q.float(), k.float(), v.float())
    assert (out[1, :, 20:] == 0).all() and (lse[1, :, 20:] == float("-inf")).all() and (dq[1, :, 20:] == 0).all()
    assert_close_to_reference(out[0], ref[0], base[0], "out (every query)")
    assert_close_to_reference(out[1, :, :20], ref[1, :, :20], base[1, :, :20], "out (the first 20 queries)")


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("lq,lk", [(100, 130), (130, 100), (20, 97)])
def test_unmasked_interior_key_tiles_with_query_lengths(lq, lk, alignment):
    """Causal attention without masks in memory runs the key tiles that no bound or diagonal crosses unmasked, rows
    past query_lengths included: those rows still give zeros, -inf LSE and no gradient; the others match."""
    (q, k, v, do, _), _ = _random_inputs(2, 2, 2, lq, lk, 16, seed=lq + lk)
    query_lengths = torch.tensor([lq, lq // 3], device=DEVICE)
    masks = {"is_causal": True, "causal_alignment": alignment}
    out, lse, dq, dk, dv = _run(triton_attention.attention, q, k, v, do, None, torch.float32, masks,
                                query_lengths=query_lengths)
    real = torch.arange(lq, device=DEVICE)[None, :] < query_lengths[:, None]
    real_rows = real[:, None, :].expand(out.shape[:3])
    assert (out[~real_rows] == 0).all() and (lse[~real_rows] == float("-inf")).all() and (dq[~real_rows] == 0).all()
    # The reference computes every row; a zero do on the rows past query_lengths takes them out of dk and dv.
    ref = _run(reference.attention, q, k, v, do * real_rows[..., None], None, torch.float64, masks)
    base = _run(reference.attention, q, k, v, do * real_rows[..., None], None, torch.float32, masks)
    for name, got, expected, baseline in (("out", out, ref[0], base[0]), ("dq", dq, ref[2], base[2])):
        assert_close_to_reference(got[real_rows], expected[real_rows], baseline[real_rows], name)
    for name, got, expected, baseline in (("dk", dk, ref[3], base[3]), ("dv", dv, ref[4], base[4])):
        assert_close_to_reference(got, expected, baseline, name)


def _padding_with_holes(lk: int) -> torch.Tensor:
    """[4, lk] key padding: right-padded (70 keys), a hole inside the third key tile with real keys after it, one
    padding key first, and none."""
    padding = torch.zeros(4, lk, dtype=torch.bool)
    padding[0, 70:] = True
    padding[1, 70:73] = True
    padding[2, 0] = True
    return padding.to(DEVICE)


def test_padding_lengths_give_the_positions_before_the_first_padding_position():
    def lengths(mask):
        found, launches = padding_lengths(mask.view(torch.uint8))
        for launch in launches:
            launch_kernel(*launch)
        return found.tolist()

    padding = _padding_with_holes(100)
    assert lengths(padding) == [[70, 100, 100, 100], [70, 70, 0, 100]]
    everything = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    assert lengths(everything) == [[0, 0], [0, 0]]
    assert lengths(everything[:, :0]) == [[0, 0], [0, 0]]
    assert lengths(torch.empty(0, 5, dtype=torch.bool, device=DEVICE)) == [[], []]
    # Rows of three blocks, 2600 apart: a right-padded one, one with a hole in its second block, one padded but for
    # positions 1024-1029 (a block's first few).
    long = torch.zeros(3, 2600, dtype=torch.bool, device=DEVICE)[:, :2500]
    long[0, 2100:] = True
    long[1, 1500] = True
    long[2, :1024] = True
    long[2, 1030:] = True
    expected = [[2100, 2500, 1030], [2100, 1500, 0]]
    assert lengths(long) == expected
    torch.manual_seed(0)
    random = torch.rand(5, 1100, device=DEVICE) < 0.5
    real = (~random).int()
    positions = torch.arange(1, 1101, device=DEVICE)
    assert lengths(random) == [(real * positions).amax(1).tolist(), real.cumprod(1).sum(1).tolist()]


@pytest.mark.parametrize("masks", [{}, {"is_causal": True}, {"is_causal": True, "causal_alignment": "bottom_right"}],
                         ids=["plain", "causal", "bottom_right"])
def test_key_padding_runs_the_tiles_before_the_first_padding_key_unmasked(masks):
    """With key padding, the key tiles before a sequence's first padding key skip the mask; the tiles from there on
    (a hole with real keys after it, a right-padded tail) are masked: a padding key that took part would move each
    output by about 1/70 of a value row."""
    lq, lk = 90, 100
    (q, k, v, do, dlse), _ = _random_inputs(4, 2, 2, lq, lk, 16, seed=11)
    padding = _padding_with_holes(lk)
    masks = {**masks, "key_padding_mask": padding}
    got = _run(triton_attention.attention, q, k, v, do, dlse, torch.float32, masks)
    ref = _run(reference.attention, q, k, v, do, dlse, torch.float64, masks)
    base = _run(reference.attention, q, k, v, do, dlse, torch.float32, masks)
    for name, out, expected, baseline in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        assert_close_to_reference(out, expected, baseline, name)


def test_kernels_read_where_the_padding_mask_starts(monkeypatch):
    """The kernels take the keys before the first padding key from KEY_LENS's second row: told (falsely) that a
    sequence with a hole has none, their two-loop path runs every key tile unmasked, and they give attention without
    the hole. The two-loop path is switched on here for the three kernels: where their plan turns it off (tiles whose
    two loops spill, such as sm_90's float32 dk/dv tile under Triton 3.6-3.8) every key tile is masked, the hole too."""
    lq, lk = 64, 64  # whole tiles: with rows or keys past a tile's end, the edge tiles would mask the hole
    tiles = []
    plan = configs.plan

    def two_loops(kernel, *args, **kwargs):
        chosen = dataclasses.replace(plan(kernel, *args, **kwargs), interior_loop=True)
        tiles.append(chosen.tile)
        return chosen

    monkeypatch.setattr(configs, "plan", two_loops)
    (q, k, v, do, _), _ = _random_inputs(1, 2, 2, lq, lk, 16, seed=12)
    padding = torch.zeros(1, lk, dtype=torch.bool, device=DEVICE)
    padding[0, 3] = True
    true_lengths = launch.padding_lengths
    monkeypatch.setattr(launch, "padding_lengths", lambda mask: true_lengths(torch.zeros_like(mask)))
    got = _run(triton_attention.attention, q, k, v, do, None, torch.float32, {"key_padding_mask": padding})
    unmasked = _run(reference.attention, q, k, v, do, None, torch.float64, {})
    base = _run(reference.attention, q, k, v, do, None, torch.float32, {})
    assert len(tiles) == 3 and all(lq % t.block_m == 0 and lk % t.block_n == 0 for t in tiles), tiles
    for name, out, expected, baseline in zip(("out", "lse", "dq", "dk", "dv"), got, unmasked, base):
        assert_close_to_reference(out, expected, baseline, f"{name} (attention without the hole)")


@pytest.mark.parametrize("fits", [False, True])
def test_kernels_take_the_interior_loop_where_the_launcher_says_it_fits(monkeypatch, fits):
    """The forward, dq and dk/dv get INTERIOR_LOOP from their plan (off for the tiles whose two loops spill), and
    either way give the reference's results for causal attention with query lengths."""
    asked, launched = [], []
    plan = configs.plan

    def planned(kernel, *args, **kwargs):
        asked.append(kernel)
        return dataclasses.replace(plan(kernel, *args, **kwargs), interior_loop=fits)

    monkeypatch.setattr(configs, "plan", planned)
    for module, attr in KERNELS[:3]:
        kernel = getattr(module, attr)

        class RecordLaunch:
            arg_names = kernel.arg_names

            def run(self, *args, kernel=kernel, **options):
                launched.append(dict(zip(kernel.arg_names, args))["INTERIOR_LOOP"])
                return kernel.run(*args, **options)

        monkeypatch.setattr(module, attr, RecordLaunch())
    (q, k, v, do, _), _ = _random_inputs(2, 2, 2, 100, 77, 16, seed=9)
    masks = {"is_causal": True, "causal_alignment": "bottom_right"}
    query_lengths = torch.tensor([100, 61], device=DEVICE)
    got = _run(triton_attention.attention, q, k, v, do, None, torch.float32, masks, query_lengths=query_lengths)
    real = (torch.arange(100, device=DEVICE)[None, :] < query_lengths[:, None])[:, None, :, None]
    ref = _run(reference.attention, q * real, k, v, do * real, None, torch.float64, masks)
    base = _run(reference.attention, q * real, k, v, do * real, None, torch.float32, masks)
    assert asked == ["fwd", "bwd_dq", "bwd_dkdv"] and launched == [fits, fits, fits]
    assert_close_to_reference(got[0], ref[0] * real, base[0] * real, "out")
    for name, out, expected, baseline in zip(("dq", "dk", "dv"), got[2:], ref[2:], base[2:]):
        rows = real if name == "dq" else 1  # rows past query_lengths: no dq
        assert_close_to_reference(out, expected * rows, baseline * rows, name)


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("extra", ["none", "query_padding", "window"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_nan_in_rows_that_are_no_queries_stays_there(monkeypatch, is_causal, extra, tma):
    """Rows past query_lengths and query padding rows are no queries: an inf or NaN in their q or do reaches none of
    out, lse and dq (nor dv, from q alone), whether the interior tiles run unmasked (their rows are dropped at the
    end) or every tile is masked (query padding, a window: their probability 0 times a NaN do is NaN, dropped too).
    Both loading paths; the rest equals the reference on the clean inputs. dk and dv still take such a NaN: they sum
    ds^T q and p^T do over the rows, and a 0 times a NaN is NaN; zeroing those rows of q and do spilled registers in
    the report (sm_90 dk/dv D128 64 x 64 tiles 80-88 B, float32 D16 16-56 B)."""
    (q, k, v, do, _), _ = _random_inputs(2, 2, 2, 100, 100, 16, seed=5)
    query_lengths = torch.tensor([100, 40], device=DEVICE)
    real = (torch.arange(100, device=DEVICE)[None, :] < query_lengths[:, None])
    masks = {"is_causal": is_causal}
    if extra == "query_padding":
        padding = torch.zeros(2, 100, dtype=torch.bool, device=DEVICE)
        padding[0, 70:75] = True
        masks["query_padding_mask"] = padding
        real = real & ~padding
    elif extra == "window":
        masks["window"] = (30, None)
    real = real[:, None, :].expand(2, 2, 100)
    clean_q, clean_do = q, do
    q, do = q.clone(), do.clone()
    q[~real] = float("nan")
    do[~real] = float("inf")
    if tma:
        decisions = _take_tma_path(monkeypatch)
    dirty = _run(triton_attention.attention, q, k, v, do, None, torch.bfloat16, masks, query_lengths=query_lengths)
    q_only = _run(triton_attention.attention, q, k, v, clean_do, None, torch.bfloat16, masks,
                  query_lengths=query_lengths)
    if tma:  # 16-bit inputs: the TMA path's dtypes
        assert decisions == [tma_available()] * 4
    out, lse, dq = dirty[:3]
    assert (out[~real] == 0).all() and (lse[~real] == float("-inf")).all() and (dq[~real] == 0).all()
    reference_masks = {name: mask for name, mask in masks.items() if name != "query_padding_mask"}
    clean_q, clean_do = torch.where(real[..., None], clean_q, 0.0), torch.where(real[..., None], clean_do, 0.0)
    ref = _run(reference.attention, clean_q, k, v, clean_do, None, torch.float64, reference_masks)
    base = _run(reference.attention, clean_q, k, v, clean_do, None, torch.bfloat16, reference_masks)
    for name, got, expected, baseline in (("out", out[real], ref[0][real], base[0][real]),
                                          ("dq", dq[real], ref[2][real], base[2][real])):
        assert_close_to_reference(got, expected, baseline, f"{name} ({extra}, causal={is_causal}, tma={tma})")
    # dv sums p^T do: with a clean do, q's NaN rows (probability 0) leave it as the reference's.
    assert_close_to_reference(q_only[4], ref[4], base[4], f"dv ({extra}, causal={is_causal}, tma={tma})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [-0.7, 0.0, 0.4])
@pytest.mark.parametrize("mask_kind", ["none", "causal"])
def test_any_scale_sign_matches_the_reference(mask_kind, scale, dtype):
    """The forward's unmasked interior key tiles take the row max before scaling, which holds for scales >= 0 only:
    a negative scale runs every tile through the masked loop, and all three signs match the reference. Scores
    spread over more than exp's float32 range, so a shift below a row's true max would overflow."""
    (q, k, v, do, _), g = _random_inputs(2, 2, 2, 100, 100, 16, seed=int(scale * 10) + 20)
    q = q * 8
    masks = _masks(mask_kind, 2, 2, 100, 100, g)
    got = _run(triton_attention.attention, q, k, v, do, None, dtype, masks, scale=scale)
    ref = _run(reference.attention, q, k, v, do, None, torch.float64, masks, scale=scale)
    base = _run(reference.attention, q, k, v, do, None, dtype, masks, scale=scale)
    for name, out, ref64, baseline in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        assert_close_to_reference(out, ref64, baseline, f"{name} (scale {scale}, {mask_kind}, {dtype})")


def _launch_options(name: str) -> dict:
    """Keyword arguments for a [2, 1, 20, 20] call, by feature."""
    padding = torch.arange(20, device=DEVICE) >= torch.tensor([[20], [11]], device=DEVICE)
    return {
        "none": lambda: {},
        "causal_query_lengths": lambda: {"is_causal": True, "causal_alignment": "bottom_right",
                                         "query_lengths": torch.tensor([20, 9], device=DEVICE)},
        "dropout": lambda: {"dropout_p": 0.1},
        "causal_key_padding": lambda: {"is_causal": True, "key_padding_mask": padding},
        "query_padding": lambda: {"query_padding_mask": padding},
        "bool_mask": lambda: {"attn_mask": torch.eye(20, dtype=torch.bool, device=DEVICE)},
        "window": lambda: {"window": (8, 0)},
    }[name]()


@pytest.mark.parametrize("name,wide", [
    ("none", True), ("causal_query_lengths", True), ("causal_key_padding", True), ("query_padding", True),
    ("window", True), ("dropout", False), ("bool_mask", False),
])
def test_kernels_take_the_wide_tiles_exactly_without_an_attn_mask_or_dropout(monkeypatch, name, wide):
    """The plan is asked for a scores-only launch (on sm_90 with TMA: the wide tiles, compiled as the report's /causal,
    /padded and /varlen/nodropout variants) for the forward, dq and dk/dv exactly when the constexprs each kernel is
    launched with carry no attn_mask and no dropout."""
    (q, k, v, do, _), _ = _random_inputs(2, 1, 1, 20, 20, 16, seed=15)
    picks, launches = [], []
    plan = configs.plan

    def record_pick(kernel_name, *args, scores_only=False, **kwargs):
        picks.append((kernel_name, scores_only))
        return plan(kernel_name, *args, scores_only=scores_only, **kwargs)

    class RecordLaunch:
        def __init__(self, kernel_name, kernel):
            self.kernel_name, self.kernel, self.arg_names = kernel_name, kernel, kernel.arg_names

        def run(self, *args, **options):
            constexprs = dict(zip(self.arg_names, args))
            scores_only = constexprs["MASK_KIND"] == launch.MASK_NONE and not constexprs["HAS_DROPOUT"]
            launches.append((self.kernel_name, scores_only))
            return self.kernel.run(*args, **options)

    monkeypatch.setattr(configs, "plan", record_pick)
    for kernel_name, (module, attr) in zip(("fwd", "bwd_dq", "bwd_dkdv"), KERNELS):
        monkeypatch.setattr(module, attr, RecordLaunch(kernel_name, getattr(module, attr)))
    q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
    triton_attention.attention(q, k, v, **_launch_options(name)).backward(do.bfloat16())
    expected = [("fwd", wide), ("bwd_dq", wide), ("bwd_dkdv", wide)]
    assert picks == launches == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "padding_causal_float_mask"])
def test_dropout_replays_exactly_in_the_reference(dtype, mask_kind):
    batch, heads, lq, lk, dim, p = 2, 2, 37, 50, 16, 0.3
    (q, k, v, do, _), g = _random_inputs(batch, heads, heads, lq, lk, dim, seed=5)
    masks = _masks(mask_kind, batch, heads, lq, lk, g)
    torch.manual_seed(11)
    seed = draw_dropout_seed(q.device)
    torch.manual_seed(11)  # the kernel draws the same seed
    got = _run(triton_attention.attention, q, k, v, do, None, dtype, masks, dropout_p=p)
    keep = triton_attention.attention_keep_mask(seed, batch, heads, lq, lk, p, q.device)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02
    ref = _run(reference.attention, q, k, v, do, None, torch.float64, masks, dropout_p=p, keep_mask=keep)
    base = _run(reference.attention, q, k, v, do, None, dtype, masks, dropout_p=p, keep_mask=keep)
    for name, out, ref64, baseline in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        assert_close_to_reference(out, ref64, baseline, f"{name} with dropout")


def test_dropout_is_reproducible_with_torch_manual_seed():
    (q, k, v, _, _), _ = _random_inputs(1, 2, 2, 33, 33, 16, seed=6)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(triton_attention.attention(q.float(), k.float(), v.float(), dropout_p=0.5))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("mask_kind", ["none", "scattered_padding_bool_mask_causal", "float_mask_with_inf"])
def test_attention_weights_kernel_matches_reference(mask_kind):
    batch, heads, lq, lk, dim = 2, 4, 37, 50, 16
    (q, k, _, _, _), g = _random_inputs(batch, heads, 2, lq, lk, dim, seed=7)
    masks = _masks(mask_kind, batch, heads, lq, lk, g)
    for dtype in (torch.float32, torch.bfloat16):
        _, lse = triton_attention.attention(q.to(dtype), k.to(dtype), k.to(dtype), return_lse=True, **masks)
        weights = triton_attention.attention_weights(q.to(dtype), k.to(dtype), lse, **masks)
        _, lse64 = reference.attention(q, k, k, return_lse=True, **masks)
        ref = reference.attention_weights(q, k, lse64, **masks)
        base = reference.attention_weights(q.to(dtype), k.to(dtype), lse.to(torch.float32), **masks)
        assert weights.dtype == dtype
        assert_close_to_reference(weights, ref, base, f"weights ({mask_kind}, {dtype})")


def test_strided_inputs_are_read_in_place():
    """q/k/v as slices of one packed [B, L, 3, H, D] projection, transposed to [B, H, L, D]: no copies."""
    batch, length, heads, dim = 2, 40, 2, 16
    packed = torch.randn(batch, length, 3, heads, dim, device=DEVICE)
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
    assert q.stride(-1) == 1 and not q.is_contiguous()
    out = triton_attention.attention(q, k, v, is_causal=True)
    ref = reference.attention(q.double(), k.double(), v.double(), is_causal=True)
    assert_close_to_reference(out, ref, reference.attention(q, k, v, is_causal=True))


def _heads_interleaved(t):
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def test_outputs_and_gradients_are_written_heads_interleaved():
    """o, dq, dk and dv come back as [B, H, L, D] laid out as [B, L, H, D]: merging the heads is a view."""
    (q, k, v, do, _), _ = _random_inputs(2, 3, 3, 37, 29, 16, seed=11)
    q, k, v, do = (t.float() for t in (q, k, v, do))
    # masks, spec (causal, alignment, window, dropout, scale, tf32), seed, score modifiers (none)
    options = (None, None, None, None, True, "top_left", None, None, 0.0, 0.25, False, None,
               *contract.score_mods_flat(contract.NO_SCORE_MODS))
    o, lse = torch.ops.fused_transformer.attention_fwd(q, k, v, *options, None, False)
    dq, dk, dv = torch.ops.fused_transformer.attention_bwd(_heads_interleaved(do), None, q, k, v, o, lse, *options)
    for t in (o, dq, dk, dv):
        assert t.transpose(1, 2).is_contiguous()
        assert t.transpose(1, 2).flatten(2).data_ptr() == t.data_ptr()


def test_rows_of_o_past_int32_are_refused_clearly(monkeypatch):
    monkeypatch.setattr(launch, "MAX_DENSE_OUTPUT_ROWS", 100)
    q = torch.randn(1, 4, 26, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"q \(1, 4, 26, 16\) has Lq x heads = 104"):
        triton_attention.attention(q, q, q)


def test_the_backward_reads_a_gradient_in_either_layout_to_the_same_bits():
    """The backward reads do in o's layout (what a module's head merge hands back) without a copy, and copies a
    do laid out otherwise: both give the same gradients, and they match the reference."""
    (q, k, v, do, _), _ = _random_inputs(2, 2, 2, 37, 29, 16, seed=12)

    def grads(do_layout):
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        out = triton_attention.attention(*leaves, is_causal=True)
        out.backward(do_layout(do.float()))
        return [t.grad for t in leaves]

    interleaved, contiguous = grads(_heads_interleaved), grads(torch.Tensor.contiguous)
    for a, b in zip(interleaved, contiguous):
        assert torch.equal(a, b)
    ref, base = (_run(reference.attention, q, k, v, do, None, dtype, {"is_causal": True})[2:]
                 for dtype in (torch.float64, torch.float32))
    for name, got, expected, baseline in zip(("dq", "dk", "dv"), interleaved, ref, base):
        assert_close_to_reference(got, expected, baseline, name)


def test_a_gradient_through_the_lse_alone():
    """With only the LSE used, the output's gradient is None in the backward (not materialised): zeros there."""
    (q, k, v, _, dlse), _ = _random_inputs(2, 2, 2, 21, 30, 16, seed=13)
    got, ref, base = [], [], []
    runs = ((triton_attention.attention, torch.float32, got), (reference.attention, torch.float64, ref),
            (reference.attention, torch.float32, base))
    for fn, dtype, into in runs:
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        _, lse = fn(*leaves, is_causal=True, return_lse=True)
        (lse * dlse.to(dtype)).sum().backward()
        into.extend(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves)  # v: no path to the LSE
    for name, a, b, baseline in zip(("dq", "dk", "dv"), got, ref, base):
        assert_close_to_reference(a, b, baseline, name)


class _RecordedOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_multihead_attention_on_triton_copies_no_head_layout_and_fills_no_gradient_with_zeros(monkeypatch):
    """The module's head merge and the gradient it hands back are views (no clone forward or backward, and the
    backward reads o where it is and do through its strides); the fused q/k/v projection's gradient is one stack of
    the three, not three zero-filled full-width slices summed; the LSE, which the module does not use, gets no zero
    gradient."""
    read_in_place = []
    output_layout = bwd.output_layout

    def spy(t):
        laid_out = output_layout(t)
        read_in_place.append(laid_out is t)
        return laid_out

    monkeypatch.setattr(bwd, "output_layout", spy)
    module = fused_transformer.MultiheadAttention(32, 4, batch_first=True, device=DEVICE)
    x = torch.randn(2, 10, 32, device=DEVICE, requires_grad=True)
    with backend.use_backend("triton"):
        with _RecordedOps() as forward:
            out, _ = module(x, x, x, need_weights=False)
        with _RecordedOps() as backward:
            out.sum().backward()
    copies = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default}
    assert not copies & set(forward.ops) and not copies & set(backward.ops)
    # Our backward ran (as the custom op here, launched directly on a GPU, where autograd's device thread runs it
    # outside the recording mode) and copied neither o nor do (read in o's layout by float32 tiles of sm_80/90).
    assert read_in_place and all(read_in_place)
    assert torch.ops.aten.stack.default in backward.ops
    assert not {torch.ops.aten.slice_backward.default, torch.ops.aten.zeros.default} & set(backward.ops)
    # The gradients against torch.nn's module in float64, with torch.nn's in float32 as the baseline.
    twins = {}
    for dtype in (torch.float32, torch.float64):
        twin = torch.nn.MultiheadAttention(32, 4, batch_first=True, device=DEVICE, dtype=dtype)
        twin.load_state_dict(module.state_dict())
        x_twin = x.detach().to(dtype).requires_grad_()
        twin(x_twin, x_twin, x_twin, need_weights=False)[0].sum().backward()
        twins[dtype] = (x_twin.grad, twin.in_proj_weight.grad)
    for name, got, ref64, baseline in zip(("dx", "d(in_proj_weight)"), (x.grad, module.in_proj_weight.grad),
                                          twins[torch.float64], twins[torch.float32]):
        assert_close_to_reference(got, ref64, baseline, name)


@pytest.mark.parametrize("strided", [True, False], ids=["do_strides", "o_layout"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_the_backward_reads_do_in_any_layout(monkeypatch, packed, strided):
    """do as autograd may hand it: in o's layout, contiguous in q's shape, a slice of a wider tensor, broadcast
    (stride 0). Where the plan's tiles read it through its strides, both backward launches read it where it lies;
    where they do not (``Plan.do_strides`` off), they read a copy in o's layout, or do itself when it is in that
    layout. The gradients are those of the same values in o's layout, bit for bit. Both ways are forced: which
    one a row takes depends on the GPU (float32 rows of sm_80/90 read o's layout)."""
    plan = configs.plan
    monkeypatch.setattr(configs, "plan", lambda *a, **kw: dataclasses.replace(plan(*a, **kw), do_strides=strided))
    g = torch.Generator().manual_seed(21)
    if packed:
        cu_seqlens = torch.tensor([0, 5, 16], dtype=torch.int32, device=DEVICE)
        q, k, v = (torch.randn(16, 3, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
        grad = torch.randn(16, 3, 16, generator=g).to(DEVICE)
        layouts = {"o": grad, "heads_first": grad.transpose(0, 1).contiguous().transpose(0, 1),
                   "slice": torch.cat([grad, grad], dim=-1)[..., 16:], "broadcast": grad[:1].expand_as(grad)}

        def run():
            return triton_attention.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 11, 11, is_causal=True)
    else:
        q, k, v = (torch.randn(2, 3, 13, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
        grad = torch.randn(2, 3, 13, 16, generator=g).to(DEVICE)
        layouts = {"o": launch.empty_output(grad).copy_(grad), "q": grad,
                   "slice": torch.cat([grad, grad], dim=-1)[..., 16:], "broadcast": grad[:1].expand_as(grad)}

        def run():
            return triton_attention.attention(q, k, v, is_causal=True)
    launched = []
    launch_kernel = bwd.launch_kernel

    def record(kernel, grid, args, *rest, **options):
        launched.append(args)
        return launch_kernel(kernel, grid, args, *rest, **options)

    monkeypatch.setattr(bwd, "launch_kernel", record)
    for name, do in layouts.items():
        launched.clear()
        got = torch.autograd.grad(run(), (q, k, v), do)
        dq_args, dkdv_args = launched
        for read, strides in ((dq_args[4], dq_args[9:12]), (dkdv_args[3], dkdv_args[8:11])):
            in_place = (read.data_ptr(), read.stride()) == (do.data_ptr(), do.stride())
            assert in_place == (strided or name == "o"), name
            assert read.stride() == launch.empty_output(do).stride() or strided, name
            assert tuple(strides) == launch.row_strides(read), name
        expected = torch.autograd.grad(run(), (q, k, v), launch.empty_output(do).copy_(do))
        for grad_name, a, b in zip(("dq", "dk", "dv"), got, expected):
            assert torch.equal(a, b), (name, grad_name)


def test_saved_tensors_grow_linearly_with_sequence_length():
    def saved_numels(length):
        q, k, v = (torch.randn(1, 2, length, 16, device=DEVICE, requires_grad=True) for _ in range(3))
        numels = []

        def pack(t):
            numels.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            triton_attention.attention(q, k, v, attn_mask=torch.ones(length, length, dtype=torch.bool,
                                                                      device=DEVICE), is_causal=True)
        return numels

    short, long = saved_numels(64), saved_numels(128)
    mask_numels = (64 * 64, 128 * 128)  # the user's own mask is kept by reference, not copied
    short_no_mask = sum(n for n in short if n != mask_numels[0])
    long_no_mask = sum(n for n in long if n != mask_numels[1])
    assert long_no_mask == 2 * short_no_mask
    assert max(n for n in long if n != mask_numels[1]) <= 2 * 128 * 16


def test_functional_dispatches_to_the_kernel_on_the_triton_backend(monkeypatch):
    (q, k, v, _, _), _ = _random_inputs(1, 2, 2, 20, 20, 16, seed=8)
    calls = []
    original = backend.ops("triton").attention_fwd

    def spy(q, k, v, masks, spec, *args):
        calls.append(spec)
        return original(q, k, v, masks, spec, *args)

    monkeypatch.setattr(backend.ops("triton"), "attention_fwd", spy)
    with backend.use_backend("triton"):
        out = functional.attention(q.float(), k.float(), v.float(), is_causal=True)
    assert len(calls) == 1 and calls[0].is_causal
    assert_close_to_reference(out, reference.attention(q, k, v, is_causal=True),
                              reference.attention(q.float(), k.float(), v.float(), is_causal=True))


def test_unsupported_inputs_raise_clear_errors():
    q = torch.randn(1, 1, 8, 300, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim=300"):
        triton_attention.attention(q, q, q)
    q = torch.randn(1, 1, 8, 16, device=DEVICE, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        triton_attention.attention(q, q, q)
    q = torch.randn(2, 1, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="query_lengths"):
        triton_attention.attention(q, q, q, query_lengths=torch.tensor([8]))
    # Called directly (as README suggests for query_lengths / allow_tf32) the kernel-level function checks what
    # functional.attention checks: these shapes read out of bounds (a segfault under the interpreter) before.
    q, k = torch.randn(1, 14, 2, 16, device=DEVICE), torch.randn(1, 10, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"q's heads \(14\) must be a multiple of k/v's heads \(10\)"):
        triton_attention.attention(q, k, k, is_causal=True)
    with pytest.raises(ValueError, match=r"v must have k's shape"):
        triton_attention.attention(q, q, q[:, :, :1])
    with pytest.raises(ValueError, match="key_padding_mask"):
        triton_attention.attention(q, q, q, key_padding_mask=torch.zeros(1, 3, dtype=torch.bool, device=DEVICE))
    # functional's keyword arguments only, by name: a misspelt one is a TypeError, not silently ignored
    with pytest.raises(TypeError, match=r"attention\(\) got unexpected keyword arguments \['casual'\]"):
        triton_attention.attention(q, q, q, casual=True)
    with pytest.raises(TypeError, match=r"attention_weights\(\) got unexpected keyword arguments \['dropout_p'\]"):
        triton_attention.attention_weights(q, q, q[..., 0], dropout_p=0.1)
    with pytest.raises(ValueError, match="window"):
        triton_attention.attention(q, q, q, window=(-1, 0))
    with pytest.raises(ValueError, match="dropout_p"):
        triton_attention.attention(q, q, q, dropout_p=1.0)


def test_float32_head_dims_above_128_are_refused_clearly():
    q = torch.randn(1, 1, 8, 160, device=DEVICE)
    with pytest.raises(ValueError, match="float32 supports head_dim up to 128"):
        triton_attention.attention(q, q, q)
    out = triton_attention.attention(q.half(), q.half(), q.half())  # 16-bit inputs take any head_dim to 256
    assert out.shape == q.shape


def test_a_mask_that_requires_grad_is_refused_not_silently_ignored():
    q = torch.randn(1, 1, 8, 16, device=DEVICE, requires_grad=True)
    mask = torch.randn(8, 8, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        triton_attention.attention(q, q, q, attn_mask=mask)
    triton_attention.attention(q, q, q, attn_mask=mask.detach())


# ------------------------------------------------------------------------------- launch limits of a GPU


class _GridRecorder:
    """Stands in for a jit kernel: records the grid of each launch, then launches the real kernel (the launchers call
    ``kernel.run(..., grid=..., warmup=False)``, what ``kernel[grid](...)`` ends in)."""

    def __init__(self, kernel, grids):
        self.kernel, self.grids, self.arg_names = kernel, grids, kernel.arg_names

    def run(self, *args, grid, **kwargs):
        self.grids.append((self.kernel.__name__, grid))
        return self.kernel.run(*args, grid=grid, **kwargs)


def test_grids_keep_batch_and_heads_on_separate_axes(monkeypatch):
    """CUDA caps grid axes 1 and 2 at 65535: batch x heads on one of them (8192 x 8, say) would not launch. Each
    kernel's grid is (tiles, heads, batch), its tiles counted with the tile the plan gives for the target the device
    reports (the interpreter's small tiles without a GPU)."""
    grids = []
    for module, name in KERNELS:
        monkeypatch.setattr(module, name, _GridRecorder(getattr(module, name), grids))
    ratios = _check(batch=3, heads=4, kv_heads=2, lq=37, lk=70, head_dim=16, mask_kind="padding_causal_float_mask")
    (q, k, _, _, _), _ = _random_inputs(3, 4, 2, 37, 70, 16, seed=1)
    _, lse = triton_attention.attention(q.float(), k.float(), k.float(), return_lse=True)
    triton_attention.attention_weights(q.float(), k.float(), lse)
    target = launch.launch_target(q.device)

    def tile(kernel, scores_only):  # float32, head_dim 16: scores_only without an attn_mask (the second call)
        return configs.plan(kernel, torch.float32, 16, target, scores_only=scores_only).tile

    rows, cols = triton.cdiv(37, tile("fwd", False).block_m), triton.cdiv(70, tile("bwd_dkdv", False).block_n)
    weights = tile("weights", True)
    assert grids == [
        ("attention_fwd_kernel", (rows, 4, 3)),
        ("attention_dq_kernel", (triton.cdiv(37, tile("bwd_dq", False).block_m), 4, 3)),
        ("attention_dkdv_kernel", (cols, 2, 3)),
        ("attention_fwd_kernel", (triton.cdiv(37, tile("fwd", True).block_m), 4, 3)),
        ("attention_weights_kernel", (triton.cdiv(37, weights.block_m) * triton.cdiv(70, weights.block_n), 4, 3)),
    ], grids
    assert set(ratios) == {"out", "lse", "dq", "dk", "dv"}
    assert launch.grid(4, 8192, 8) == (4, 8, 8192)  # the shape issue 17 found unlaunchable


def test_a_grid_past_cuda_limits_is_refused_clearly():
    with pytest.raises(ValueError, match="batch=65536 is more than a CUDA grid axis holds"):
        launch.grid(1, 65536, 1)


def test_masks_spanning_2_31_elements_get_int64_offsets():
    big = torch.empty((1, 1, 2**16 + 1, 2**15), device="meta")  # its last element is 2**31 + 2**15 - 1 away
    assert launch.mask_offsets_need_int64(big)
    assert not launch.mask_offsets_need_int64(big[:, :, : 2**16])  # 2**31 - 1 still fits in int32
    # broadcast rows (stride 0) never step past one row
    broadcast_rows = torch.empty((1, 2**15), device="meta").expand(1, 1, 2**20, 2**15)
    assert not launch.mask_offsets_need_int64(broadcast_rows)
    transposed = torch.empty((2**15, 2**16 + 1), device="meta").t()[None, None]  # column stride 2**16 + 1
    assert launch.mask_offsets_need_int64(transposed)


@pytest.mark.parametrize("mask_kind", ["float_mask", "scattered_padding_bool_mask_causal"])
def test_int64_mask_offsets_match_the_reference(monkeypatch, mask_kind):
    """The int64 path a 2**31-element mask takes, run on small shapes by lowering the threshold."""
    monkeypatch.setattr(launch, "INT32_OFFSET_LIMIT", 1)
    _check(mask_kind=mask_kind, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------- TMA loads (sm_90)


def _take_tma_path(monkeypatch) -> list:
    """Switch the interpreter's TMA loads on (on a GPU the hardware decides) and return the list that records, per
    forward, backward and weights launch, whether its plan chose TMA (the backward's dk/dv kernel loads as its dq
    kernel does)."""
    decisions = []
    plan = configs.plan

    def record(kernel, *args, **kwargs):
        chosen = plan(kernel, *args, **kwargs)
        if kernel == "bwd_dkdv":
            assert chosen.use_tma == decisions[-1], "the backward's two kernels load differently"
        else:
            decisions.append(chosen.use_tma)
        return chosen

    monkeypatch.setattr(configs, "plan", record)
    monkeypatch.setattr(configs, "TMA_UNDER_INTERPRETER", True)
    monkeypatch.setattr(configs, "TMA_MIN_SCORES", 0)  # a GPU's launches this small read through pointers
    return decisions


def _loads_through_tma(*inputs, kernel="bwd_dq", allow_tf32=False) -> bool:
    """What the plan decides for a ``kernel`` launch that loads ``inputs`` (the backward's kernels by default, which
    take TMA for 16-bit inputs only)."""
    return configs.plan(kernel, inputs[0].dtype, inputs[0].shape[-1], launch.launch_target(inputs[0].device),
                        allow_tf32=allow_tf32, tma_addressable=all(map(tma_addressable, inputs))).use_tma


def tma_available() -> bool:
    """Whether inputs TMA can address take the TMA path here: under the interpreter once switched on, on a GPU from
    sm_90."""
    return interpreting() or target_of(torch.device(DEVICE)).tma


# The coarsest precision each output dtype is computed in: float32 launches may run tf32 products.
_COMPUTE_EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -11}


def _assert_same(tma, pointer, names):
    """The TMA path loads the values the pointer path loads (zeros past the bounds) into the same arithmetic: the
    same bits under the interpreter, whose plans give both paths one tile. On a GPU the TMA rows have tiles of their
    own, which sum in another order: the two agree to a few roundings of the precision computed in."""
    for name, got, expected in zip(names, tma, pointer):
        msg = f"{name}: TMA vs pointer path"
        if interpreting():
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True, msg=msg)
            continue
        tolerance = 8 * _COMPUTE_EPS[expected.dtype]
        finite = expected[expected.isfinite()]
        scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * scale, equal_nan=True, msg=msg)


@pytest.mark.parametrize("batch,lq,lk,heads,kv_heads,head_dim,dtype,mask_kind", [
    (1, 7, 7, 2, 2, 24, torch.bfloat16, "none"),
    (1, 77, 77, 1, 1, 48, torch.float16, "causal"),
    (2, 1, 77, 1, 1, 16, torch.bfloat16, "causal_bottom_right"),
    (2, 37, 50, 1, 1, 24, torch.bfloat16, "padding_causal_float_mask"),
    (2, 33, 40, 2, 1, 16, torch.bfloat16, "scattered_padding_bool_mask_causal"),
    (2, 40, 33, 2, 1, 40, torch.float16, "key_padding"),
], ids=lambda value: str(value).replace("torch.", ""))
def test_tma_loads_match_the_pointer_path_and_reference(monkeypatch, batch, lq, lk, heads, kv_heads, head_dim,
                                                        dtype, mask_kind):
    """Odd lengths, head dims that are not a power of two (TMA zero-fills the padded columns), grouped-query heads,
    causal and padding masks: output, LSE and every gradient, through the LSE too."""
    (q, k, v, do, dlse), g = _random_inputs(batch, heads, kv_heads, lq, lk, head_dim, seed=lq + lk + head_dim)
    masks = _masks(mask_kind, batch, heads, lq, lk, g)
    pointer = _run(triton_attention.attention, q, k, v, do, dlse, dtype, masks)
    decisions = _take_tma_path(monkeypatch)
    tma = _run(triton_attention.attention, q, k, v, do, dlse, dtype, masks)
    assert decisions == [tma_available()] * 2  # forward, backward
    _assert_same(tma, pointer, ("out", "lse", "dq", "dk", "dv"))
    ref = _run(reference.attention, q, k, v, do, dlse, torch.float64, masks)
    base = _run(reference.attention, q, k, v, do, dlse, dtype, masks)
    for name, out, ref64, baseline in zip(("out", "lse", "dq", "dk", "dv"), tma, ref, base):
        assert_close_to_reference(out, ref64, baseline, f"{name} (TMA, {mask_kind}, {dtype})")


@pytest.mark.parametrize("head_dim,mask_kind", [(40, "padding_causal_float_mask"), (64, "causal"), (72, "none")])
def test_tf32_loads_through_tma_at_its_head_dims(monkeypatch, head_dim, mask_kind):
    """The forward in float32 with allow_tf32 takes the TMA path at head dims 33..128 (configs.TF32_TMA_HEAD_DIMS; the
    interpreter computes its products in float32, so it gives the pointer path's values); the backward, exact float32
    and other head dims keep the pointer path. Past 128 no tile serves float32 (configs.MAX_HEAD_DIM), tf32 or not:
    the argument checks refuse it at the kernel-level entry, and the route sends it elsewhere, before any plan is
    asked."""
    (q, k, v, do, dlse), g = _random_inputs(2, 2, 1, 37, 50, head_dim, seed=head_dim)
    masks = _masks(mask_kind, 2, 2, 37, 50, g)
    pointer = _run(triton_attention.attention, q, k, v, do, dlse, torch.float32, masks, allow_tf32=True)
    decisions = _take_tma_path(monkeypatch)
    tma = _run(triton_attention.attention, q, k, v, do, dlse, torch.float32, masks, allow_tf32=True)
    assert decisions == [tma_available(), False]  # forward, backward
    _assert_same(tma, pointer, ("out", "lse", "dq", "dk", "dv"))
    del decisions[:]
    _run(triton_attention.attention, q, k, v, do, dlse, torch.float32, masks)
    assert decisions == [False] * 2
    q16, k16, v16 = (t[..., :16].float().contiguous() for t in (q, k, v))
    assert not _loads_through_tma(q16, k16, v16, kernel="fwd", allow_tf32=True)
    del decisions[:]
    head_dim_256 = [t.float().repeat(1, 1, 1, -(-256 // head_dim))[..., :256].contiguous() for t in (q, k, v)]
    refusal = r"triton attention: float32 supports head_dim up to 128, got 256; use float16/bfloat16 inputs"
    with pytest.raises(ValueError, match=refusal):
        triton_attention.attention(*head_dim_256, allow_tf32=True, **masks)
    with fused_transformer.use_backend("triton"), fused_transformer.explain() as calls:  # the route falls back
        fused_transformer.attention(*head_dim_256, **masks)
    assert [(c.backend, c.reason) for c in calls] == [
        ("reference", "backend 'triton' does not compute float32 head dims above 128")]
    assert decisions == []  # refused before any plan lookup


def test_tma_loads_strided_views_of_a_fused_projection_in_place(monkeypatch):
    """q/k/v as slices of one [B, L, 3, H, D] projection: their row stride 3 H D is 16-byte aligned, so TMA reads
    them through 4-D descriptors as they lie."""
    batch, length, heads, dim = 1, 37, 2, 24
    g = torch.Generator().manual_seed(12)
    packed64 = torch.randn(batch, length, 3, heads, dim, generator=g, dtype=torch.float64).to(DEVICE)
    do = torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64).to(DEVICE)

    def run(dtype):
        packed = packed64.to(dtype, copy=True).requires_grad_()
        q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
        fn = triton_attention.attention if dtype != torch.float64 else reference.attention
        out = fn(q, k, v, is_causal=True)
        (out * do.to(dtype)).sum().backward()
        return out, packed.grad

    pointer = run(torch.bfloat16)
    decisions = _take_tma_path(monkeypatch)
    tma = run(torch.bfloat16)
    assert decisions == [tma_available()] * 2
    _assert_same(tma, pointer, ("out", "d(qkv)"))
    for name, got, ref64, baseline in zip(("out", "d(qkv)"), tma, run(torch.float64), run(torch.bfloat16)):
        assert_close_to_reference(got, ref64, baseline, f"{name} (TMA, strided views)")


def test_tma_attention_weights_match_the_pointer_path(monkeypatch):
    (q, k, _, _, _), g = _random_inputs(2, 4, 2, 37, 50, 24, seed=13)
    q, k = q.bfloat16(), k.bfloat16()
    masks = _masks("scattered_padding_bool_mask_causal", 2, 4, 37, 50, g)
    _, lse = triton_attention.attention(q, k, k, return_lse=True, **masks)
    pointer = triton_attention.attention_weights(q, k, lse, **masks)
    decisions = _take_tma_path(monkeypatch)
    tma = triton_attention.attention_weights(q, k, lse, **masks)
    assert decisions == [tma_available()]
    _assert_same((tma,), (pointer,), ("weights",))


def test_tma_is_refused_for_inputs_it_cannot_address(monkeypatch):
    """TMA needs a 16-byte aligned base and strides (but the last, 1): anything else, and float32 (whose exact
    products run from registers), takes the pointer path, with the same results."""
    decisions = _take_tma_path(monkeypatch)
    (q, k, v, _, _), _ = _random_inputs(1, 2, 2, 37, 37, 16, seed=14)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    odd_rows = torch.zeros(1, 2, 37, 17, dtype=torch.bfloat16, device=DEVICE)[..., :16]  # row stride 34 bytes
    odd_rows.copy_(q)
    odd_base = torch.zeros(q.numel() + 1, dtype=torch.bfloat16, device=DEVICE)[1:].view(q.shape)  # base + 2 bytes
    odd_base.copy_(q)
    head_dim_7 = q[..., :7].contiguous()  # row stride 14 bytes
    assert not _loads_through_tma(odd_rows, k, v)
    assert not _loads_through_tma(q, odd_base, v)
    assert not _loads_through_tma(head_dim_7, head_dim_7, head_dim_7)
    assert not _loads_through_tma(q.float(), k.float(), v.float())
    assert not _loads_through_tma(q.float(), k.float(), v.float(), kernel="fwd", allow_tf32=True)  # head dim 16
    assert _loads_through_tma(q, k, v) == tma_available()
    # A size-1 dim's stride is never used: any value passes (one query row, its row stride 3 elements).
    one_row = torch.empty_strided((1, 2, 1, 16), (32, 16, 3, 1), dtype=torch.bfloat16, device=DEVICE)
    assert _loads_through_tma(one_row, k, v) == tma_available()
    del decisions[:]
    out = triton_attention.attention(odd_rows, k, v, is_causal=True)
    assert decisions == [False]
    ref = reference.attention(q.double(), k.double(), v.double(), is_causal=True)
    base = reference.attention(q, k, v, is_causal=True)
    assert_close_to_reference(out, ref, base, "out (pointer path for an unaligned row stride)")


# The forward's variants (configs.VARIANTS) other than the default that the interpreter runs: the tile orders. They
# serve scores-only dense launches in 16 bits at head dims 64 and 128; batch 3 so that a persistent program walks several
# batch elements.
TILE_ORDER_VARIANTS = [v.name for v in configs.VARIANTS if v.tile_order != configs.GRID_ORDER and not v.refused]


@pytest.mark.parametrize("variant", TILE_ORDER_VARIANTS)
@pytest.mark.parametrize("mask_kind", ["none", "key_padding", "key_padding_scattered", "causal", "causal_bottom_right"])
def test_tile_order_variants_match_reference(variant, mask_kind):
    """The forward's, and where the variant has one the dq kernel's, tile order."""
    from fused_transformer.kernels import variants

    lq = 40 if mask_kind == "causal_bottom_right" else 77
    forced = {op: variant for op in ("attention.fwd", "attention.bwd") if variant in variants.registered()[op][1]}
    for kernel, op in (("fwd", "attention.fwd"), ("bwd_dq", "attention.bwd")):
        planned = configs.plan(kernel, torch.bfloat16, 64, None, scores_only=True, variant=variant)
        expected = configs.VARIANTS_BY_NAME[variant].tile_order if op in forced else configs.GRID_ORDER
        assert planned.tile_order == expected and planned.constexprs()["TILE_ORDER"] == expected
    with variants.forced(forced):
        _check(batch=3, heads=2, kv_heads=1, lq=lq, lk=77, head_dim=64, dtype=torch.bfloat16, mask_kind=mask_kind,
               seed=len(mask_kind))


@pytest.mark.parametrize("variant", TILE_ORDER_VARIANTS)
def test_variants_leave_the_launches_they_do_not_serve_to_the_default(variant):
    default = configs.DEFAULT_VARIANT
    assert configs.plan("fwd", torch.bfloat16, 64, None, scores_only=False, variant=variant).variant == default
    assert configs.plan("fwd", torch.float32, 64, None, scores_only=True, variant=variant).variant == default
    assert configs.plan("fwd", torch.bfloat16, 32, None, scores_only=True, variant=variant).variant == default
    assert configs.plan("fwd", torch.bfloat16, 64, None, scores_only=True, packed=True, variant=variant).variant == default
    assert configs.plan("bwd_dkdv", torch.bfloat16, 64, None, scores_only=True, variant=variant).variant == default
