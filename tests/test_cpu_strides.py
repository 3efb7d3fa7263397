"""The cpu backend's attention on every layout torch can hand it (issue 15): a size-1 sequence dim whose stride is 1
or 0 (torch calls such a tensor contiguous, and ``.contiguous()`` keeps it), rows broadcast or overlapping, batch
and heads expanded, seq-first views, a strided last dim; on q, k, v and the output gradient, and on the masks.
Forward and every gradient against the float64 reference run on contiguous copies. Shapes are chosen so that the
block products reach BLAS (which refuses an illegal leading dimension and then leaves its output unwritten)."""
import pytest
import torch

import fused_transformer as ft
from fused_transformer import backend, reference

pytestmark = pytest.mark.skipif(backend.cpu_unavailable_reason() is not None,
                                reason=f"cpu backend unavailable: {backend.cpu_unavailable_reason()}")

B, H, D = 2, 2, 64
TOLERANCE = dict(rtol=1e-4, atol=2e-5)


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor of ``t``'s shape ``[B, H, L, D]`` in ``layout`` (values may repeat where the layout broadcasts)."""
    b, h, length, d = t.shape
    if layout == "contiguous":
        return t
    if layout == "single_row_stride_1":  # L = 1: a [B, H, D, 1] tensor transposed
        assert length == 1
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "single_row_stride_0":
        assert length == 1
        return torch.empty_strided(t.shape, (h * d, d, 0, 1)).copy_(t)
    if layout == "rows_broadcast":  # every row the same (stride 0 along the sequence)
        return t[:, :, :1].expand(-1, -1, length, -1)
    if layout == "batch_heads_expanded":
        return t[:1, :1].expand(b, h, -1, -1)
    if layout == "seq_first":  # [L, B, H, D] storage, as a seq-first projection gives
        return t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    if layout == "overlapping_rows":  # row stride D / 2: neighbouring rows share half their values
        row = d // 2
        base = torch.randn(b, h, length * row + d)
        return base.as_strided(t.shape, (h * base.shape[-1], base.shape[-1], row, 1))
    if layout == "every_other_element":  # last dim strided
        return torch.randn(b, h, length, 2 * d)[..., ::2]
    raise ValueError(layout)


SINGLE_ROW = ["single_row_stride_1", "single_row_stride_0"]
MANY_ROWS = ["rows_broadcast", "batch_heads_expanded", "seq_first", "overlapping_rows", "every_other_element"]
# (which tensor takes the layout, its sequence length, the other's, layouts)
CASES = ([("q", 1, 128, layout) for layout in SINGLE_ROW] + [("dout", 1, 128, layout) for layout in SINGLE_ROW]
         + [("k", 1, 64, layout) for layout in SINGLE_ROW] + [("v", 1, 64, layout) for layout in SINGLE_ROW]
         + [(name, 64, 128, layout) for name in ("q", "k", "v", "dout") for layout in MANY_ROWS])


def run(q, k, v, dout, **masks):
    """Output and q/k/v gradients on the current backend."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = ft.attention(*leaves, **masks)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def check_against_float64(tensors, **masks):
    with ft.use_backend("cpu"):
        got = run(*tensors, **masks)
    with ft.use_backend("reference"):
        expected = run(*(t.contiguous().double() for t in tensors),
                       **{n: m.contiguous() if torch.is_tensor(m) else m for n, m in masks.items()})
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b, **TOLERANCE, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("which, length, other, layout", CASES,
                         ids=[f"{w}-L{n}-{layout}" for w, n, _, layout in CASES])
def test_attention_reads_every_layout(which, length, other, layout):
    torch.manual_seed(15)
    lq, lk = (length, other) if which in ("q", "dout") else (other, length)
    shapes = {"q": (B, H, lq, D), "k": (B, H, lk, D), "v": (B, H, lk, D), "dout": (B, H, lq, D)}
    tensors = {name: torch.randn(shape) for name, shape in shapes.items()}
    tensors[which] = laid_out(tensors[which], layout)
    check_against_float64([tensors[n] for n in ("q", "k", "v", "dout")], is_causal=which != "k" and lq > 1)


MASKS = {
    "bool_transposed": lambda lq, lk: {"attn_mask": (torch.rand(lk, lq) > 0.3).t()},
    "float_broadcast_over_keys": lambda lq, lk: {"attn_mask": torch.randn(lq, 1).expand(lq, lk)},
    "float_single_row_stride_1": lambda lq, lk: {"attn_mask": torch.randn(lk, 1).t()[None, None]},
    "float_expanded_batch_heads": lambda lq, lk: {"attn_mask": torch.randn(1, 1, lq, lk).expand(B, H, lq, lk)},
    "padding_transposed": lambda lq, lk: {
        "key_padding_mask": (torch.arange(lk)[:, None] >= torch.tensor([lk, lk // 2])[None, :]).t()},
}


@pytest.mark.parametrize("lq", [1, 64])
@pytest.mark.parametrize("kind", list(MASKS))
def test_attention_reads_every_mask_layout(kind, lq):
    torch.manual_seed(16)
    lk = 128
    masks = MASKS[kind](lq, lk)
    if "attn_mask" in masks and masks["attn_mask"].dtype == torch.bool:
        masks["attn_mask"][..., 0] = True  # every query keeps a key
    tensors = [torch.randn(B, H, lq, D), torch.randn(B, H, lk, D), torch.randn(B, H, lk, D), torch.randn(B, H, lq, D)]
    check_against_float64(tensors, **masks)


def test_reference_takes_the_same_layouts():
    """The oracle itself does not depend on the layout."""
    torch.manual_seed(17)
    q = laid_out(torch.randn(B, H, 1, D).double(), "single_row_stride_1")
    k, v = torch.randn(B, H, 9, D).double(), torch.randn(B, H, 9, D).double()
    torch.testing.assert_close(reference.attention(q, k, v), reference.attention(q.contiguous(), k, v))
