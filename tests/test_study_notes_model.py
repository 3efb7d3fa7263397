"""The Seq2Seq code our users learned from: its attention layer takes a padding mask [B, 1, 1, S] and a
decoder mask ``pad & tril`` [B, 1, T, T] (1 = may attend) and fills masked energies with -1e10. Swapping
its inner computation for ``fused_transformer.attention`` with those very masks must not change it."""
import math

import pytest
import torch
from torch import nn

import fused_transformer as ft

PAD = 0


class NotesAttention(nn.Module):
    """Multi-head attention as the study notes write it; ``fused=True`` swaps the inner computation."""

    def __init__(self, hid_dim, n_heads, fused):
        super().__init__()
        self.n_heads, self.head_dim, self.fused = n_heads, hid_dim // n_heads, fused
        self.fc_q, self.fc_k, self.fc_v, self.fc_o = (nn.Linear(hid_dim, hid_dim) for _ in range(4))

    def forward(self, query, key, value, mask):
        batch = query.shape[0]
        q, k, v = (fc(x).view(batch, -1, self.n_heads, self.head_dim).permute(0, 2, 1, 3)
                   for fc, x in ((self.fc_q, query), (self.fc_k, key), (self.fc_v, value)))
        if self.fused:
            x = ft.attention(q, k, v, attn_mask=mask.bool())
        else:
            energy = torch.matmul(q, k.permute(0, 1, 3, 2)) / math.sqrt(self.head_dim)
            energy = energy.masked_fill(mask == 0, -1e10)
            x = torch.matmul(torch.softmax(energy, dim=-1), v)
        return self.fc_o(x.permute(0, 2, 1, 3).reshape(batch, -1, self.n_heads * self.head_dim))


def make_src_mask(src):
    return (src != PAD).unsqueeze(1).unsqueeze(2)


def make_trg_mask(trg):
    pad_mask = (trg != PAD).unsqueeze(1).unsqueeze(2)
    causal = torch.tril(torch.ones(trg.shape[1], trg.shape[1], dtype=torch.bool))
    return pad_mask & causal


@pytest.mark.parametrize("which", ["encoder_self", "decoder_self", "cross"])
def test_notes_attention_is_unchanged_by_the_fused_op(which):
    torch.manual_seed(0)
    notes, fused = NotesAttention(32, 8, fused=False).double(), NotesAttention(32, 8, fused=True).double()
    fused.load_state_dict(notes.state_dict())
    src = torch.randint(1, 50, (4, 9))
    trg = torch.randint(1, 50, (4, 6))
    src[1, 6:], src[3, 2:] = PAD, PAD
    trg[2, 4:] = PAD
    src_h, trg_h = torch.randn(4, 9, 32, dtype=torch.float64), torch.randn(4, 6, 32, dtype=torch.float64)
    query, memory, mask = {
        "encoder_self": (src_h, src_h, make_src_mask(src)),
        "decoder_self": (trg_h, trg_h, make_trg_mask(trg)),
        "cross": (trg_h, src_h, make_src_mask(src)),
    }[which]
    expected = notes(query, memory, memory, mask)
    out = fused(query, memory, memory, mask)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
