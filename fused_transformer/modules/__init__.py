"""Drop-in twins of the torch.nn Transformer modules, running on the fused functional ops.

Each class subclasses its ``torch.nn`` namesake and adds no state: constructor, defaults, attributes,
``state_dict`` keys, parameter initialisation (the same random draws) and ``isinstance`` checks are
torch's own. Only ``forward`` changes: it composes ``fused_transformer.functional`` ops.

One intended difference: a query that may attend to no key at all (every key masked) gives an output
row of zeros where torch.nn gives NaN. Weights returned with ``need_weights=True`` are the attention
probabilities before dropout (torch.nn returns them after dropout in training mode).

What the fused path does not handle runs torch.nn's own ``forward`` instead, with torch.nn's results and
errors: NestedTensor inputs, parameters of mixed dtypes, dropout modules replaced by other modules, and
``torch.jit.script`` (which scripts the torch.nn module sharing these parameters). Under ``torch.compile`` a
mask is not compared with the causal mask (that branches on data): it is applied as given, with the same
result; pass ``is_causal=True`` to get the causal kernel there.

Padding costs nothing. Given a bool key padding mask ``[B, S]`` (True = padding), the encoder and decoder
layers and stacks (and so ``Transformer``) gather the real tokens once, packed sequence after sequence
(right or left padding and holes alike), run projections, attention (``attention_varlen``), LayerNorm and
feed-forward on those tokens only, and scatter the result back: **the output at padded positions is zero**
(torch.nn's eval fast path writes zeros there too; its other paths leave values no later computation
should read), and a sequence of padding only gives zeros. Real positions equal the padded computation to
round-off, gradients included. The stacks pack once for all their layers, whose forward hooks then see the
packed ``[tokens, d_model]`` tensors (as torch.nn's fast path shows its layers nested tensors). What cannot
be packed runs padded and still writes zeros at padded positions: other attention masks than the causal
one, a ``memory_mask``, a hooked ``MultiheadAttention``, ``add_bias_kv`` / ``add_zero_attn``, norms other
than a LayerNorm over the last dim, and ``torch.compile`` / ``torch.export`` (packing has data-dependent
shapes).
"""
from . import attention, base, layers, stacks
from .attention import *  # noqa: F401,F403  (each module's __all__: its public classes)
from .base import *  # noqa: F401,F403
from .layers import *  # noqa: F401,F403
from .stacks import *  # noqa: F401,F403

__all__ = [*base.__all__, *attention.__all__, *layers.__all__, *stacks.__all__]

# The public classes are fused_transformer.modules.X wherever they are defined (their reprs and pickles say so).
for _name in __all__:
    _public = globals()[_name]
    if isinstance(_public, type):
        _public.__module__ = __name__
