"""Triton attention's newer masks against the float64 reference: packed variable-length sequences
(``attention_varlen``), query padding with per-sequence causal alignment, and local windows, whose key tiles
outside every window are skipped, not only masked.

Runs on CUDA when present, else on CPU tensors under the Triton interpreter (set up in conftest.py): shapes stay
small, but cross several 32 x 32 interpreter tiles.
"""
import pytest
import torch

from fused_transformer import backend, contract, functional, reference
from fused_transformer.kernels import attention as triton_attention
from fused_transformer.kernels.attention import configs
from fused_transformer.kernels._common import draw_dropout_seed, interpreting
from tests.numerics import DEVICE, assert_close_to_reference
from tests.test_attention_triton import _assert_same, _take_tma_path, tma_available

pytestmark = pytest.mark.usefixtures("interpreter_rounds_to_nearest", "nan_filled_outputs")

NAMES = ("out", "lse", "dq", "dk", "dv")


def _cu_seqlens(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _packed_inputs(lens_q, lens_k, heads, kv_heads, head_dim, seed):
    """float64 q [Tq, H, D], k, v [Tk, Hkv, D], do [Tq, H, D], dlse [H, Tq] and the cu_seqlens of the lengths."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(tk, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(tk, kv_heads, head_dim, generator=g, dtype=torch.float64)
    do = torch.randn(tq, heads, head_dim, generator=g, dtype=torch.float64)
    dlse = torch.randn(heads, tq, generator=g, dtype=torch.float64)
    return [t.to(DEVICE) for t in (q, k, v, do, dlse)], _cu_seqlens(lens_q), _cu_seqlens(lens_k)


def _backward(out, lse, do, dlse, inputs):
    loss = (out * do.to(out.dtype)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * dlse.to(lse.dtype)).sum()
    loss.backward()
    return (out, lse, *(t.grad for t in inputs))


def _run_varlen(fn, q, k, v, do, dlse, dtype, *seqlens, **options):
    """Output, LSE and (dq, dk, dv) of ``fn`` on packed inputs cast to ``dtype``."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, *seqlens, return_lse=True, **options)
    return _backward(out, lse, do, dlse, (q, k, v))


def _check_varlen(lens_q, lens_k, dtype=torch.float32, heads=2, kv_heads=2, head_dim=16, seed=0, with_dlse=False,
                  max_extra=0, **options):
    (q, k, v, do, dlse), cu_q, cu_k = _packed_inputs(lens_q, lens_k, heads, kv_heads, head_dim, seed)
    dlse = dlse if with_dlse else None
    seqlens = (cu_q, cu_k, max(lens_q) + max_extra, max(lens_k) + max_extra)
    got = _run_varlen(triton_attention.attention_varlen, q, k, v, do, dlse, dtype, *seqlens, **options)
    ref = _run_varlen(reference.attention_varlen, q, k, v, do, dlse, torch.float64, *seqlens, **options)
    base = _run_varlen(reference.attention_varlen, q, k, v, do, dlse, dtype, *seqlens, **options)
    for name, out, ref64, baseline in zip(NAMES, got, ref, base):
        assert out.shape == baseline.shape and out.dtype == baseline.dtype, name
        assert_close_to_reference(out, ref64, baseline, f"{name} (varlen {options}, {dtype})")
    return got


# Several sequences: one empty, lengths on both sides of the 32-row interpreter tile, one a multiple of it.
LENS = [37, 0, 5, 64, 33]
# Cross attention: len_q != len_k, a sequence with queries but no keys, one with keys but no queries.
LENS_Q, LENS_K = [20, 0, 45, 7, 3], [50, 9, 33, 0, 40]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("options", [{}, {"is_causal": True}], ids=["full", "causal"])
def test_varlen_matches_reference_per_sequence(dtype, options):
    _check_varlen(LENS, LENS, dtype=dtype, **options)


@pytest.mark.parametrize("options", [
    {},
    {"is_causal": True},
    {"is_causal": True, "causal_alignment": "bottom_right"},
    {"window": (6, 2), "causal_alignment": "bottom_right"},
    {"window": (10, None), "is_causal": True, "causal_alignment": "bottom_right"},
], ids=["full", "causal_top_left", "causal_bottom_right", "window_bottom_right", "window_causal_bottom_right"])
def test_varlen_cross_attention_lengths(options):
    _check_varlen(LENS_Q, LENS_K, dtype=torch.bfloat16, **options)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_varlen_grouped_query_attention(kv_heads):
    _check_varlen(LENS_Q, LENS_K, dtype=torch.bfloat16, heads=4, kv_heads=kv_heads, is_causal=True,
                  causal_alignment="bottom_right")


@pytest.mark.parametrize("window", [(4, 4), (0, 0), (None, 3), (20, None)])
def test_varlen_window(window):
    _check_varlen(LENS, LENS, window=window)


@pytest.mark.parametrize("lens_q,lens_k,kv_heads,head_dim,options", [
    ([33, 0, 7, 32], [33, 0, 7, 32], 2, 24, {"is_causal": True}),
    ([7, 0, 77], [7, 3, 77], 1, 48, {"window": (5, 9), "causal_alignment": "bottom_right"}),
    (LENS_Q, LENS_K, 1, 16, {}),
], ids=["causal_d24", "window_gqa_d48", "cross_gqa_d16"])
def test_varlen_tma_loads_match_the_pointer_path_and_reference(monkeypatch, lens_q, lens_k, kv_heads, head_dim,
                                                               options):
    """Packed [T, H, D] inputs through 3-D-as-4-D descriptors ([1, H, T, D]): rows past a sequence's end are the
    next sequence's (past T, zeros), masked out as the pointer path's zeros are."""
    (q, k, v, do, dlse), cu_q, cu_k = _packed_inputs(lens_q, lens_k, 2, kv_heads, head_dim, seed=0)
    pointer = _run_varlen(triton_attention.attention_varlen, q, k, v, do, dlse, torch.bfloat16, cu_q, cu_k,
                          max(lens_q), max(lens_k), **options)
    decisions = _take_tma_path(monkeypatch)
    tma = _check_varlen(lens_q, lens_k, torch.bfloat16, kv_heads=kv_heads, head_dim=head_dim, with_dlse=True,
                        **options)
    assert decisions == [tma_available()] * 2
    _assert_same(tma, pointer, NAMES)


def test_varlen_tma_reads_slices_of_a_packed_projection(monkeypatch):
    """q, k, v as slices of one [T, 3, H, D] projection (row stride 3 H D, 16-byte aligned) load through TMA."""
    lens = [37, 5, 20]
    g = torch.Generator().manual_seed(21)
    qkv = torch.randn(sum(lens), 3, 2, 16, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    cu = _cu_seqlens(lens)
    q, k, v = qkv.unbind(1)
    pointer = triton_attention.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=True)
    decisions = _take_tma_path(monkeypatch)
    tma = triton_attention.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), is_causal=True)
    assert decisions == [tma_available()]
    _assert_same((tma,), (pointer,), ("out",))


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lens", [[5, 7, 20], [40, 7, 70]], ids=["short", "interior_tiles"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
def test_a_nan_in_one_packed_sequence_stays_out_of_the_others(monkeypatch, tma, lens, is_causal):
    """Sequence 0 ends inside a tile whose other rows are sequence 1's, all NaN (q, k, v and do): every result of
    sequences 0 and 2 equals the run without the NaN, forward and backward, in both loading paths, with sequences
    shorter than a tile and with sequences whose tiles before the last run the unmasked interior loops."""
    (q, k, v, do, dlse), cu, _ = _packed_inputs(lens, lens, 2, 2, 16, seed=4)
    nan_start, nan_end = lens[0], lens[0] + lens[1]
    poisoned = [t.clone() for t in (q, k, v, do)]
    for t in poisoned:
        t[nan_start:nan_end] = float("nan")
    if tma:
        decisions = _take_tma_path(monkeypatch)
    longest = max(lens)
    clean = _run_varlen(triton_attention.attention_varlen, q, k, v, do, dlse, torch.bfloat16, cu, cu, longest,
                        longest, is_causal=is_causal)
    dirty = _run_varlen(triton_attention.attention_varlen, *poisoned, dlse, torch.bfloat16, cu, cu, longest, longest,
                        is_causal=is_causal)
    if tma:
        assert decisions == [tma_available()] * 4
    for name, expected, got in zip(NAMES, clean, dirty):
        rows = (slice(None), slice(0, nan_start)) if name == "lse" else (slice(0, nan_start),)
        assert got[rows].isfinite().all(), f"{name}: sequence 1's NaN reached sequence 0"
        torch.testing.assert_close(got[rows], expected[rows], rtol=0, atol=0, msg=name)
        outside = (slice(None), slice(nan_end, None)) if name == "lse" else (slice(nan_end, None),)
        torch.testing.assert_close(got[outside], expected[outside], rtol=0, atol=0, msg=name)


def test_varlen_gradient_through_lse_and_a_grid_wider_than_the_sequences():
    _check_varlen(LENS_Q, LENS_K, with_dlse=True, max_extra=40, is_causal=True, causal_alignment="bottom_right",
                  window=(12, None))


def test_varlen_rows_without_keys_give_zeros():
    got = _check_varlen(LENS_Q, LENS_K, is_causal=True)
    out, lse, dq = got[0], got[1], got[2]
    rows = slice(sum(LENS_Q[:3]), sum(LENS_Q[:4]))  # the sequence with 7 queries and no key
    assert (out[rows] == 0).all() and (lse[:, rows] == float("-inf")).all() and (dq[rows] == 0).all()
    keys = slice(LENS_K[0], LENS_K[0] + LENS_K[1])  # 9 keys and no query
    assert (got[3][keys] == 0).all() and (got[4][keys] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_dropout_replays_exactly_in_the_reference(dtype):
    heads, p = 2, 0.3
    max_q, max_k = max(LENS_Q), max(LENS_K)
    (q, k, v, do, dlse), cu_q, cu_k = _packed_inputs(LENS_Q, LENS_K, heads, heads, 16, seed=5)
    options = dict(is_causal=True, causal_alignment="bottom_right", window=(30, None), dropout_p=p)
    torch.manual_seed(11)
    seed = draw_dropout_seed(q.device)
    torch.manual_seed(11)  # the kernel draws the same seed
    got = _run_varlen(triton_attention.attention_varlen, q, k, v, do, dlse, dtype, cu_q, cu_k, max_q, max_k,
                      **options)
    keep = triton_attention.attention_keep_mask(seed, len(LENS_Q), heads, max_q, max_k, p, q.device)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.02
    ref = _run_varlen(reference.attention_varlen, q, k, v, do, dlse, torch.float64, cu_q, cu_k, max_q, max_k,
                      keep_mask=keep, **options)
    base = _run_varlen(reference.attention_varlen, q, k, v, do, dlse, dtype, cu_q, cu_k, max_q, max_k,
                       keep_mask=keep, **options)
    for name, out, ref64, baseline in zip(NAMES, got, ref, base):
        assert_close_to_reference(out, ref64, baseline, f"{name} with dropout")


def test_functional_attention_varlen_dispatches_to_the_kernel(monkeypatch):
    (q, k, v, _, _), cu_q, cu_k = _packed_inputs(LENS_Q, LENS_K, 2, 1, 16, seed=8)
    calls = []
    original = backend.ops("triton").attention_varlen_fwd

    def spy(q, k, v, seqs, spec, *args):
        calls.append(spec)
        return original(q, k, v, seqs, spec, *args)

    monkeypatch.setattr(backend.ops("triton"), "attention_varlen_fwd", spy)
    args = (cu_q, cu_k, max(LENS_Q), max(LENS_K))
    with backend.use_backend("triton"):
        out, lse = functional.attention_varlen(q.float(), k.float(), v.float(), *args, is_causal=True,
                                               window=(5, None), return_lse=True)
    assert len(calls) == 1 and calls[0].window == (5, None)
    ref, ref_lse = reference.attention_varlen(q, k, v, *args, is_causal=True, window=(5, None), return_lse=True)
    base, base_lse = reference.attention_varlen(q.float(), k.float(), v.float(), *args, is_causal=True,
                                                window=(5, None), return_lse=True)
    assert lse.shape == (2, sum(LENS_Q)) and lse.is_contiguous()
    assert_close_to_reference(out, ref, base, "out")
    assert_close_to_reference(lse, ref_lse, base_lse, "lse")  # -inf where a sequence has no key, in both


def test_varlen_ops_pass_opcheck():
    """Schema, fake (meta) functions and autograd registration of the packed ops, as torch.compile needs them."""
    (q, k, v, do, _), cu_q, cu_k = _packed_inputs([9, 0, 4], [5, 3, 7], 2, 1, 16, seed=9)
    q, k, v, do = (t.float() for t in (q, k, v, do))
    # the sequences, spec (causal, alignment, window, dropout, scale, tf32), seed, score modifiers (none)
    args = (cu_q, cu_k, 9, 7, True, "bottom_right", 3, None, 0.0, 0.5, False, None,
            *contract.score_mods_flat(contract.NO_SCORE_MODS))
    torch.library.opcheck(torch.ops.fused_transformer.attention_varlen_fwd, (q, k, v, *args, None, False),
                          test_utils=("test_schema", "test_faketensor"))
    o, lse = torch.ops.fused_transformer.attention_varlen_fwd(q, k, v, *args, None, False)
    torch.library.opcheck(torch.ops.fused_transformer.attention_varlen_bwd, (do, lse * 0, q, k, v, o, lse, *args),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist only on a GPU")
def test_varlen_kernels_never_sync_with_the_host():
    (q, k, v, do, _), cu_q, cu_k = _packed_inputs(LENS_Q, LENS_K, 2, 2, 64, seed=10)
    q, k, v = (t.half().requires_grad_() for t in (q, k, v))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = triton_attention.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), is_causal=True,
                                                window=(8, None), dropout_p=0.1)
        out.backward(do.half())
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ----------------------------------------------------------------------------- dense: query padding, window


def _run(fn, q, k, v, do, dtype, masks):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v, return_lse=True, **masks)
    return _backward(out, lse, do, None, (q, k, v))


def _dense_inputs(batch, heads, kv_heads, lq, lk, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads, lq, head_dim), (batch, kv_heads, lk, head_dim), (batch, kv_heads, lk, head_dim),
              (batch, heads, lq, head_dim))
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE) for s in shapes], g


def _padding(lengths, length):
    return (torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]).to(DEVICE)


def _check_dense(masks, dtype=torch.float32, batch=3, heads=2, kv_heads=2, lq=45, lk=50, seed=0):
    (q, k, v, do), _ = _dense_inputs(batch, heads, kv_heads, lq, lk, 16, seed)
    got = _run(triton_attention.attention, q, k, v, do, dtype, masks)
    ref = _run(reference.attention, q, k, v, do, torch.float64, masks)
    base = _run(reference.attention, q, k, v, do, dtype, masks)
    for name, out, ref64, baseline in zip(NAMES, got, ref, base):
        assert out.shape == baseline.shape and out.dtype == baseline.dtype, name
        assert_close_to_reference(out, ref64, baseline, f"{name} ({sorted(masks)}, {dtype})")
    return got


def _dense_masks(kind, batch=3, lq=45, lk=50):
    g = torch.Generator().manual_seed(1)
    query_right = _padding([lq, 20, 1][:batch], lq)
    key_right = _padding([lk, 30, 7][:batch], lk)
    scattered_q = (torch.rand(batch, lq, generator=g) < 0.3).to(DEVICE)
    scattered_q[-1, 40:] = True  # the last query rows of one sequence are padding: its alignment moves
    bottom_right = {"causal_alignment": "bottom_right"}
    return {
        "query_padding": {"query_padding_mask": query_right},
        "query_padding_scattered": {"query_padding_mask": scattered_q, "attn_mask": (
            torch.rand(lq, lk, generator=g) < 0.8).to(DEVICE)},
        "query_padding_causal_bottom_right": {"query_padding_mask": query_right, "is_causal": True, **bottom_right},
        "query_and_key_padding_causal_bottom_right": {
            "query_padding_mask": scattered_q, "key_padding_mask": key_right, "is_causal": True, **bottom_right},
        "window": {"window": (6, 3)},
        "window_left_only_causal": {"window": (9, None), "is_causal": True},
        "window_right_only_bottom_right": {"window": (None, 2), **bottom_right},
        "window_diagonal": {"window": (0, 0)},
        "window_query_padding_bottom_right": {"window": (5, 5), "query_padding_mask": scattered_q, **bottom_right},
        "window_causal_padding_per_sequence": {
            "window": (12, 5), "is_causal": True, "query_padding_mask": query_right, "key_padding_mask": key_right,
            "attn_mask": torch.randn(batch, 1, lq, lk, generator=g).to(DEVICE), **bottom_right},
    }[kind]


DENSE_KINDS = (
    "query_padding", "query_padding_scattered", "query_padding_causal_bottom_right",
    "query_and_key_padding_causal_bottom_right", "window", "window_left_only_causal",
    "window_right_only_bottom_right", "window_diagonal", "window_query_padding_bottom_right",
    "window_causal_padding_per_sequence",
)


@pytest.mark.parametrize("kind", DENSE_KINDS)
def test_dense_query_padding_and_window_match_reference(kind):
    _check_dense(_dense_masks(kind))


@pytest.mark.parametrize("kind", ["query_and_key_padding_causal_bottom_right", "window_causal_padding_per_sequence"])
def test_dense_new_masks_in_bfloat16_with_grouped_heads(kind):
    _check_dense(_dense_masks(kind), dtype=torch.bfloat16, heads=4, kv_heads=2)


def test_query_padding_rows_are_zero_and_pass_no_gradient():
    masks = _dense_masks("query_and_key_padding_causal_bottom_right")
    out, lse, dq, _, _ = _check_dense(masks)
    padding = masks["query_padding_mask"][:, None, :].expand(out.shape[:3])
    assert (out[padding] == 0).all() and (lse[padding] == float("-inf")).all() and (dq[padding] == 0).all()
    # a padding query's do reaches nothing: changing it changes no gradient, not by a bit
    (q, k, v, do), _ = _dense_inputs(3, 2, 2, 45, 50, 16, seed=0)
    other_do = do + 100.0 * padding[..., None]
    clean = _run(triton_attention.attention, q, k, v, do, torch.float32, masks)[2:]
    for got, expected in zip(_run(triton_attention.attention, q, k, v, other_do, torch.float32, masks)[2:], clean):
        assert torch.equal(got, expected)


def test_query_padding_combines_with_query_lengths():
    masks = _dense_masks("query_padding_causal_bottom_right")
    (q, k, v, _), _ = _dense_inputs(3, 2, 2, 45, 50, 16, seed=2)
    lengths = torch.tensor([30, 45, 45], device=DEVICE)
    out = triton_attention.attention(q.float(), k.float(), v.float(), query_lengths=lengths, **masks)
    combined = dict(masks, query_padding_mask=masks["query_padding_mask"] | _padding([30, 45, 45], 45))
    assert_close_to_reference(out, reference.attention(q, k, v, **combined),
                              reference.attention(q.float(), k.float(), v.float(), **combined))


@pytest.mark.parametrize("kind", ["query_padding_scattered", "window_causal_padding_per_sequence",
                                  "window_right_only_bottom_right"])
def test_attention_weights_with_the_new_masks(kind):
    masks = _dense_masks(kind)
    (q, k, _, _), _ = _dense_inputs(3, 4, 2, 45, 50, 16, seed=7)
    for dtype in (torch.float32, torch.bfloat16):
        _, lse = triton_attention.attention(q.to(dtype), k.to(dtype), k.to(dtype), return_lse=True, **masks)
        weights = triton_attention.attention_weights(q.to(dtype), k.to(dtype), lse, **masks)
        _, lse64 = reference.attention(q, k, k, return_lse=True, **masks)
        ref = reference.attention_weights(q, k, lse64, **masks)
        base = reference.attention_weights(q.to(dtype), k.to(dtype), lse.to(torch.float32), **masks)
        assert weights.dtype == dtype
        assert_close_to_reference(weights, ref, base, f"weights ({kind}, {dtype})")


def test_functional_attention_passes_the_new_masks_to_the_kernel():
    masks = _dense_masks("window_causal_padding_per_sequence")
    (q, k, v, _), _ = _dense_inputs(3, 2, 2, 45, 50, 16, seed=3)
    with backend.use_backend("triton"):
        out, lse = functional.attention(q.float(), k.float(), v.float(), return_lse=True, **masks)
        weights = functional.attention_weights(q.float(), k.float(), lse, **masks)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **masks)
    base, base_lse = reference.attention(q.float(), k.float(), v.float(), return_lse=True, **masks)
    assert_close_to_reference(out, ref, base, "out")
    assert_close_to_reference(weights, reference.attention_weights(q, k, ref_lse, **masks),
                              reference.attention_weights(q.float(), k.float(), base_lse, **masks), "weights")


# --------------------------------------------------------------------------------- window tiles are skipped


@pytest.mark.skipif(not interpreting(), reason="the positions below are placed on the interpreter's 32 x 32 tiles")
@pytest.mark.parametrize("side", ["left", "right"])
def test_key_tiles_outside_every_window_are_not_visited(side):
    """96 queries and keys (three 32-wide tiles), window (8, 8). A key outside the window of every row of a query
    tile lies, for one side, in a tile that query tile skips, and for the middle tile, in a tile it visits with
    that key masked. A NaN in v there is visible only where the tile is visited (p = 0 times NaN is NaN in the
    tile's product): the skipped query tile's output and dq stay exact, the visiting one's are NaN. The same for
    a NaN in do, seen from the dk/dv kernel's query loop."""
    assert triton_attention.INTERPRETER_TILE.block_m == triton_attention.INTERPRETER_TILE.block_n == 32
    masks = {"window": (8, 8)}
    (q, k, v, do), _ = _dense_inputs(1, 1, 1, 96, 96, 16, seed=4)
    key, clean_rows = (10, slice(64, 96)) if side == "left" else (90, slice(0, 32))
    query, clean_keys = (80, slice(0, 32)) if side == "left" else (10, slice(64, 96))
    nan_v = v.clone()
    nan_v[..., key, :] = float("nan")
    nan_do = do.clone()
    nan_do[..., query, :] = float("nan")
    ref = _run(reference.attention, q, k, v, do, torch.float64, masks)

    out, _, dq, _, _ = _run(triton_attention.attention, q, k, nan_v, do, torch.float32, masks)
    for name, got, expected in (("out", out, ref[0]), ("dq", dq, ref[2])):
        torch.testing.assert_close(got[..., clean_rows, :].double(), expected[..., clean_rows, :], atol=2e-5,
                                   rtol=0, msg=name)
        assert got[..., 32:64, :].isnan().all(), f"{name}: the NaN placement is not observable"

    _, _, _, dk, dv = _run(triton_attention.attention, q, k, v, nan_do, torch.float32, masks)
    for name, got, expected in (("dk", dk, ref[3]), ("dv", dv, ref[4])):
        torch.testing.assert_close(got[..., clean_keys, :].double(), expected[..., clean_keys, :], atol=2e-5,
                                   rtol=0, msg=name)
        assert got[..., 32:64, :].isnan().all(), f"{name}: the NaN placement is not observable"


def test_packed_launches_ask_for_the_packed_tiles(monkeypatch):
    """Every kernel of an attention_varlen call plans for packed sequences (the packed rows on sm_90), and of a dense
    call for dense ones."""
    picks = []
    plan = configs.plan

    def record_pick(kernel_name, *args, packed=False, **kwargs):
        picks.append((kernel_name, packed))
        return plan(kernel_name, *args, packed=packed, **kwargs)

    monkeypatch.setattr(configs, "plan", record_pick)
    (q, k, v, do, _), cu_q, cu_k = _packed_inputs([5, 9], [7, 3], 2, 2, 16, seed=4)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    triton_attention.attention_varlen(q, k, v, cu_q, cu_k, 9, 7, is_causal=True).backward(do.float())
    assert picks == [("fwd", True), ("bwd_dq", True), ("bwd_dkdv", True)]
    picks.clear()
    dense = (t.detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v))  # [1, H, L, D]
    triton_attention.attention(*dense, is_causal=True).sum().backward()
    assert picks == [("fwd", False), ("bwd_dq", False), ("bwd_dkdv", False)]


def test_kernel_level_varlen_checks_shapes_as_functional_does():
    """kernels.attention.attention_varlen checks what functional.attention_varlen checks but cu_seqlens' values:
    mismatched heads are an error, not out-of-bounds reads."""
    (q, k, v, _, _), cu_q, cu_k = _packed_inputs([5, 9], [7, 3], 2, 2, 16, seed=4)
    q, k, v = q.float(), k.float(), v.float()
    with pytest.raises(ValueError, match=r"q's heads \(2\) must be a multiple of k/v's heads \(3\)"):
        triton_attention.attention_varlen(q, k.repeat(1, 2, 1)[:, :3], v.repeat(1, 2, 1)[:, :3], cu_q, cu_k, 9, 7)
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        triton_attention.attention_varlen(q, k, v, cu_q, cu_k.long(), 9, 7)
    with pytest.raises(ValueError, match="same number of sequences"):
        triton_attention.attention_varlen(q, k, v, cu_q, cu_k[:2], 9, 7)
    with pytest.raises(ValueError, match="dropout_p"):
        triton_attention.attention_varlen(q, k, v, cu_q, cu_k, 9, 7, dropout_p=-0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offsets_kept_on_the_host_cost_no_device_read():
    """``cu_seqlens`` on the CPU with q on a GPU (as the packed modules keep them): checked there, copied, and the
    call, backward included, never waits for the GPU (torch's sync debug mode raises on any synchronising call); the
    results are those of the same offsets on the GPU."""
    (q, k, v, do, _), cu_q, cu_k = _packed_inputs([5, 0, 33], [5, 0, 33], 4, 2, 32, seed=41)
    q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
    host = cu_q.cpu()
    results = []
    for offsets in (host, cu_q):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if offsets is host else "default")
        try:
            out = functional.attention_varlen(*leaves, offsets, offsets, 33, 33, is_causal=True)
            out.backward(do)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append((out, *(t.grad for t in leaves)))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="end at the packed length"):  # and still refuses bad offsets
        functional.attention_varlen(q, k, v, torch.tensor([0, 5, 5, 30], dtype=torch.int32), host, 33, 33)
