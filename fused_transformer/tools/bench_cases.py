"""The benchmark suites: every case that ``python -m fused_transformer bench`` and ``pytest benchmarks/`` measure,
the implementations compared in each, the work counted, and how time and memory are measured.

Suites (``SUITES``), each over sequence lengths:

- ``attention``: ``ft.attention`` forward (under ``no_grad``) and forward+backward, no mask / causal / 50% key
  padding (and causal + 50% padding on CUDA); head dim 64 on CPU (B 8, H 8), 64 and 128 on CUDA (16k tokens per
  batch, 2048 / D heads). Against ``F.scaled_dot_product_attention`` with its default dispatch (the baseline,
  ``sdpa``) and under each ``sdpa_kernel`` backend for this device (``sdpa:math``, ``sdpa:flash_attention``, and
  on CUDA ``sdpa:efficient_attention``, ``sdpa:cudnn_attention``), plus ``flash_attn`` and ``xformers`` on CUDA
  when installed. SDPA gets the padding as a boolean ``attn_mask`` (its only way to take it).
- every registered op (``fused_transformer.ops``): the op's ``Op.bench`` examples, forward and forward+backward,
  against its torch path (``Op.torch_path``: torch.nn's own ops computing the same result).
- ``encoder_layer`` / ``decoder_layer``: ``ft.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` against the
  ``torch.nn`` layer holding the same weights (dropout 0.1, batch_first, post-norm); a training step (forward +
  backward) and an eval forward under ``no_grad`` (torch.nn then takes its fast path), without padding and
  with 50% key padding; the decoder self-attention is causal and its memory has the target's length. The
  encoder also runs seq-first (``batch_first=False``, torch.nn's default) with a causal float mask, as the
  PyTorch examples' word-language model does.
- ``decode_step``: one cached greedy-decoding step (a token per sequence) of the study notes' Seq2Seq model
  (``fused_transformer.models``, d 256, 3 + 3 layers, 8 heads, ff 512) against its torch.nn twin on the same
  weights, after a prefix of L - 1 target tokens over a source of L tokens; tokens/s counts one token per
  sequence.
- ``decode``: one decoding step of ``ft.attention_with_kvcache`` (append the new key and value to a contiguous cache
  of L - 1 keys, attend with one query per sequence; the lengths on the host, as SDPA's slice takes them, so that
  no call waits for the GPU) against SDPA on the same cache after the same write, and
  ``flash_attn_with_kvcache`` on CUDA when installed; batch 1, 8, 32 (and 128 on CUDA), 8 KV heads with 8 or 32
  query heads. GB/s counts the cache read (keys and values), its fraction of the GPU's peak in ``bw_of_peak``.
- ``module_call``: one call of ``ft.LayerNorm``, ``MultiheadAttention`` (``need_weights=False``), and the encoder and
  decoder layers on a tiny input (batch 2, L 4, d_model 32, 4 heads, d_ff 64), eval under ``no_grad`` and a training
  step, against the ``torch.nn`` module with the same weights: at this size the time is almost all per-call Python
  and dispatch overhead, which a one-token decoding step or a small-batch model pays on every module.

The attention suite also runs batch 1, 1 head (``B1H1 causal``): one (batch, head) pair, whose backward must
still use every thread; and causal ALiBi (``causal+alibi``, the paper's slopes): ours in the kernel, SDPA with the
bias materialised as a float mask ``[1, H, L, L]`` (built outside the timed call), FlashAttention with its slopes.

"ours" runs on the ``auto`` backend: the C++ kernels for CPU tensors, Triton for CUDA tensors.

Padding: sequences alternately keep ``1 - 3p/2`` and ``1 - p/2`` of their keys (p = 0.5: a quarter and three
quarters), right-padded, so a padding ratio p removes the fraction p of the keys of a batch.

Work counted: ``bench_work`` (FLOPs and bytes a case needs, whatever the implementation).

Time and peak memory: ``bench_timing``.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fused_transformer as ft
from fused_transformer import ops
from fused_transformer.tools.bench_work import attention_flops, kept_lengths, padding_ratio

SUITES = ("attention", *ops.names(), "encoder_layer", "decoder_layer", "decode_step", "decode", "module_call")
DROPOUT = 0.1
GPU_ATTENTION_TOKENS = 16384  # tokens per batch on CUDA: batch = 16384 // L (at least 2)

# Default sequence lengths: (device type, suite) -> (full, --quick); a registered op's are its ``Op.lengths``.
LENGTHS = {
    ("cpu", "attention"): ((128, 256, 512, 1024, 2048), (128, 512)),
    ("cpu", "encoder_layer"): ((128, 256, 512), (128,)),
    ("cpu", "decoder_layer"): ((128, 256, 512), (128,)),
    ("cpu", "decode_step"): ((16, 64, 128), (16,)),
    ("cpu", "decode"): ((512, 2048), (512,)),
    ("cpu", "module_call"): ((4,), (4,)),
    ("cuda", "attention"): ((512, 1024, 2048, 4096, 8192, 16384), (1024, 4096)),
    ("cuda", "encoder_layer"): ((512, 1024, 2048, 4096), (1024, 4096)),
    ("cuda", "decoder_layer"): ((512, 1024, 2048, 4096), (1024, 4096)),
    ("cuda", "decode_step"): ((64, 256, 1024), (256,)),
    ("cuda", "decode"): ((512, 2048, 8192, 32768), (2048, 8192)),
    ("cuda", "module_call"): ((4,), (4,)),
}

@dataclass(frozen=True)
class Setup:
    """Where and how every case runs."""

    device: torch.device
    dtype: torch.dtype
    backend: str = "auto"  # the fused_transformer backend "ours" runs on


@dataclass
class Built:
    """A case made concrete: one zero-argument callable per implementation (the thing timed), and the tensors
    whose ``.grad`` is reset to None before every call so that each call does the same work."""

    fns: Dict[str, Callable[[], object]]
    grads: List[Tensor] = field(default_factory=list)
    notes: Dict[str, str] = field(default_factory=dict)  # impl -> a remark for the CSV's note column


@dataclass(frozen=True)
class Case:
    """One measurement point; ``build()`` allocates its tensors (call it when about to time it)."""

    suite: str
    case: str  # mask or shape label, e.g. "causal", "pad50%", "d1024"
    mode: str  # "fwd", "fwd+bwd" (ops), "train", "eval" (layers)
    seq_len: int
    batch: int
    impls: Tuple[str, ...]  # the baseline first
    build: Callable[[], Built] = field(repr=False, compare=False)
    heads: Optional[int] = None
    head_dim: Optional[int] = None
    d_model: Optional[int] = None
    d_ff: Optional[int] = None
    causal: bool = False
    padding: float = 0.0  # fraction of the keys that are padding
    flops: Optional[float] = None  # work counted, for TFLOP/s
    nbytes: Optional[float] = None  # bytes counted, for GB/s
    new_tokens: Optional[int] = None  # tokens a call produces, when not batch * seq_len (a decoding step)

    @property
    def baseline(self) -> str:
        return self.impls[0]

    @property
    def tokens(self) -> int:
        return self.new_tokens if self.new_tokens is not None else self.batch * self.seq_len

    @property
    def id(self) -> str:
        head_dim = f"-D{self.head_dim}" if self.suite == "attention" else ""
        return f"{self.suite}-{self.case.replace(' ', '_')}-{self.mode}-L{self.seq_len}{head_dim}"


# ------------------------------------------------------------------------------------------- competitors


def sdpa_backends(device: torch.device) -> Dict[str, object]:
    """``sdpa:<name>`` -> ``SDPBackend`` for the backends SDPA has on this device type."""
    from torch.nn.attention import SDPBackend

    names = ("math", "flash_attention") if device.type == "cpu" else (
        "flash_attention", "efficient_attention", "cudnn_attention", "math")
    return {f"sdpa:{name}": SDPBackend.__members__[name.upper()] for name in names}


def sdpa_dispatch(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], causal: bool) -> Optional[str]:
    """The backend SDPA's default dispatch picks for these inputs (a private torch function: None if absent)."""
    try:
        choice = int(torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, causal))
        from torch.nn.attention import SDPBackend

        return next(name.lower() for name, member in SDPBackend.__members__.items() if int(member.value) == choice)
    except Exception:  # noqa: BLE001 (private API: any failure only loses a note)
        return None


@functools.lru_cache(maxsize=None)
def third_party(name: str) -> Optional[object]:
    """The flash_attn / xformers.ops module, or None when it is not installed."""
    try:
        return importlib.import_module({"flash_attn": "flash_attn", "xformers": "xformers.ops"}[name])
    except ImportError:
        return None


def competitor_notes(device: torch.device) -> List[str]:
    """What is measured against, and what is left out and why: to print loudly before a run."""
    notes = [f"sdpa backends tried: {', '.join(name[5:] for name in sdpa_backends(device))} "
             "(a backend that refuses a case is left out of it, and the table says so)"]
    if device.type != "cuda":
        notes.append("flash_attn, xformers: CUDA only, not measured on this device")
        return notes
    for name, pip in (("flash_attn", "flash-attn"), ("xformers", "xformers")):
        if third_party(name) is None:
            notes.append(f"{name}: NOT INSTALLED, its rows are left out (pip install {pip})")
        else:
            notes.append(f"{name}: measured without padding (padding needs its varlen API, not measured here)")
    return notes


# --------------------------------------------------------------------------------------------- builders


def _forward(fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
    def run() -> Tensor:
        with torch.no_grad():
            return fn()
    return run


def _forward_backward(fn: Callable[[], Tensor], grad: Tensor) -> Callable[[], None]:
    def run() -> None:
        fn().backward(grad)
    return run


def _on_backend(backend: str, fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """``fn`` run on ``backend``; ``fn`` itself when that is already the choice, so that no case times a
    context manager's few microseconds that torch's side does not pay."""
    if ft.backend.get_backend() == backend:
        return fn

    def run() -> Tensor:
        with ft.use_backend(backend):
            return fn()
    return run


def _randn(setup: Setup, *shape: int, scale: float = 1.0, grad: bool = False) -> Tensor:
    t = torch.randn(*shape, device=setup.device, dtype=setup.dtype) * scale
    return t.requires_grad_(grad)


def _padding_mask(kept: Sequence[int], length: int, device: torch.device) -> Tensor:
    """``[B, L]`` bool, True = padding (the torch.nn convention)."""
    return torch.arange(length, device=device)[None, :] >= torch.tensor(list(kept), device=device)[:, None]


def alibi_slopes(heads: int, device: torch.device) -> Tensor:
    """The ALiBi paper's slopes for ``heads`` heads (a power of two): ``2^(-8 (h + 1) / heads)``."""
    return torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, dtype=torch.float32, device=device) / heads)


def _build_attention(setup: Setup, impls: Tuple[str, ...], batch: int, heads: int, length: int, head_dim: int,
                     causal: bool, kept: Optional[List[int]], backward: bool, alibi: bool = False) -> Built:
    torch.manual_seed(0)
    q, k, v = (_randn(setup, batch, heads, length, head_dim, grad=backward) for _ in range(3))
    grad = _randn(setup, batch, heads, length, head_dim)
    key_padding = _padding_mask(kept, length, setup.device) if kept is not None else None
    sdpa_mask = slopes = None
    if key_padding is not None:
        sdpa_mask = ~key_padding[:, None, None, :]
        if causal:
            sdpa_mask = sdpa_mask & torch.ones(length, length, dtype=torch.bool, device=setup.device).tril()
    if alibi:
        # SDPA takes ALiBi only as a float bias [1, H, L, L], built here outside the timed call (ours: in the kernel).
        slopes = alibi_slopes(heads, setup.device)
        positions = torch.arange(length, device=setup.device)
        distance = (positions[:, None] - positions[None, :]).abs().to(q.dtype)
        sdpa_mask = -slopes.to(q.dtype)[:, None, None] * distance
        if causal:
            sdpa_mask = sdpa_mask.masked_fill(positions[None, :] > positions[:, None], float("-inf"))
        sdpa_mask = sdpa_mask[None]

    def sdpa() -> Tensor:
        if sdpa_mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def under(backend: object) -> Callable[[], Tensor]:
        def run() -> Tensor:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel([backend]):
                return sdpa()
        return run

    def ours() -> Tensor:
        return ft.attention(q, k, v, key_padding_mask=key_padding, is_causal=causal, alibi_slopes=slopes)

    # "ours" as a user calls it (on "auto", routed to SDPA where the route table measured it faster); "ours:triton"
    # our kernel whatever the route.
    calls: Dict[str, Callable[[], Tensor]] = {"sdpa": sdpa, "ours": _on_backend(setup.backend, ours),
                                              "ours:triton": _on_backend("triton", ours)}
    calls.update({name: under(backend) for name, backend in sdpa_backends(setup.device).items()})
    grads = [q, k, v]
    if "flash_attn" in impls or "xformers" in impls:
        # Both take [B, L, H, D]: transposed copies made here, outside the timed call.
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_(backward) for t in (q, k, v))
        grad_t = grad.transpose(1, 2).contiguous()
        grads += [qt, kt, vt]
        if "flash_attn" in impls:
            calls["flash_attn"] = lambda: third_party("flash_attn").flash_attn_func(qt, kt, vt, causal=causal,
                                                                                    alibi_slopes=slopes)
        if "xformers" in impls:
            xops = third_party("xformers")
            calls["xformers"] = lambda: xops.memory_efficient_attention(
                qt, kt, vt, attn_bias=xops.LowerTriangularMask() if causal else None)
    fns = {}
    for name in impls:
        out_grad = grad_t if name in ("flash_attn", "xformers") else grad
        fns[name] = _forward_backward(calls[name], out_grad) if backward else _forward(calls[name])
    dispatch = sdpa_dispatch(q, k, v, sdpa_mask, causal and sdpa_mask is None)
    return Built(fns, grads, {"sdpa": f"dispatch {dispatch}"} if dispatch else {})


def attention_cases(setup: Setup, lengths: Sequence[int]) -> Iterator[Case]:
    gpu = setup.device.type == "cuda"
    masks = [("none", False, 0.0), ("causal", True, 0.0), ("pad50%", False, 0.5)]
    if gpu:
        masks.append(("causal+pad50%", True, 0.5))
    for head_dim in (64, 128) if gpu else (64,):
        for mask, causal, padding in masks + [("B1H1 causal", True, 0.0), ("causal+alibi", True, 0.0)]:
            alibi = mask.endswith("alibi")
            impls = ("sdpa", "ours", *sdpa_backends(setup.device))
            if gpu and setup.backend == "auto":
                impls += ("ours:triton",)
            if gpu and padding == 0.0:
                # xFormers has no ALiBi of its own (a materialised bias, as SDPA's), FlashAttention does.
                impls += tuple(name for name in ("flash_attn", "xformers") if third_party(name) is not None
                               and not (alibi and name == "xformers"))
            for mode in ("fwd", "fwd+bwd"):
                for length in lengths:
                    batch, heads = (max(GPU_ATTENTION_TOKENS // length, 2), 2048 // head_dim) if gpu else (8, 8)
                    if mask.startswith("B1H1"):
                        batch, heads = 1, 1
                    kept = kept_lengths(batch, length, padding)
                    backward = mode == "fwd+bwd"
                    yield Case(
                        "attention", mask, mode, length, batch, impls, heads=heads, head_dim=head_dim,
                        d_model=heads * head_dim, causal=causal, padding=padding_ratio(kept, length),
                        flops=attention_flops(batch, heads, length, head_dim, causal=causal, kept=kept,
                                              backward=backward),
                        build=functools.partial(_build_attention, setup, impls, batch, heads, length, head_dim,
                                                causal, kept if padding else None, backward, alibi),
                    )


def _build_op(setup: Setup, op: ops.Op, example: ops.Example, backward: bool) -> Built:
    """A registered op's example: ours (its public function) against its torch path, on the same tensors."""
    torch.manual_seed(0)
    tensors = example.draw(lambda *shape, scale=1.0: _randn(setup, *shape, scale=scale))
    leaves = [t.requires_grad_(backward) for t in tensors.values() if t is not None]
    calls = {"torch": lambda: op.torch_path(**tensors, **example.options),
             "ours": _on_backend(setup.backend, lambda: op.function(**tensors, **example.options))}
    if not backward:
        return Built({name: _forward(fn) for name, fn in calls.items()}, leaves)
    grad = torch.randn_like(calls["torch"]())
    return Built({name: _forward_backward(fn, grad) for name, fn in calls.items()}, leaves)


def op_cases(op: ops.Op, setup: Setup, lengths: Sequence[int]) -> Iterator[Case]:
    """A registered op's bench cases (``Op.bench``), forward and forward + backward."""
    examples = op.bench(setup.device.type == "cuda", lengths)
    for label in dict.fromkeys(example.label for example in examples):
        for mode in ("fwd", "fwd+bwd"):
            for example in (e for e in examples if e.label == label):
                backward = mode == "fwd+bwd"
                shape = example.shape
                work = op.work(example, setup.dtype.itemsize, backward)
                yield Case(op.name, label, mode, shape["seq_len"], shape["batch"], ("torch", "ours"),
                           d_model=shape.get("d_model"), d_ff=shape.get("d_ff"), flops=work.flops,
                           nbytes=work.nbytes, build=functools.partial(_build_op, setup, op, example, backward))


def _build_layer(setup: Setup, decoder: bool, batch: int, length: int, d_model: int, heads: int, d_ff: int,
                 kept: Optional[List[int]], train: bool, seq_first: bool = False) -> Built:
    torch.manual_seed(0)
    torch_class = nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer
    ours_class = ft.TransformerDecoderLayer if decoder else ft.TransformerEncoderLayer
    theirs = torch_class(d_model, heads, d_ff, dropout=DROPOUT, batch_first=not seq_first, device=setup.device,
                         dtype=setup.dtype)
    ours = ours_class(d_model, heads, d_ff, dropout=DROPOUT, batch_first=not seq_first, device=setup.device,
                      dtype=setup.dtype)
    ours.load_state_dict(theirs.state_dict())
    shape = (length, batch, d_model) if seq_first else (batch, length, d_model)
    x, memory, grad = (_randn(setup, *shape) for _ in range(3))
    padding = _padding_mask(kept, length, setup.device) if kept is not None else None
    causal = torch.ones(length, length, dtype=torch.bool, device=setup.device).triu(1)  # True = masked

    def call(layer: nn.Module) -> Callable[[], Tensor]:
        if decoder:
            return lambda: layer(x, memory, tgt_mask=causal, tgt_key_padding_mask=padding,
                                 memory_key_padding_mask=padding, tgt_is_causal=True)
        if seq_first:  # the word-language model's call: a float causal mask, flagged causal
            float_causal = nn.Transformer.generate_square_subsequent_mask(length, setup.device, setup.dtype)
            return lambda: layer(x, src_mask=float_causal, is_causal=True)
        return lambda: layer(x, src_key_padding_mask=padding)

    fns = {}
    for name, layer, fn in (("torch.nn", theirs, call(theirs)), ("ours", ours, _on_backend(setup.backend, call(ours)))):
        layer.train(train)
        fns[name] = _forward_backward(fn, grad) if train else _forward(fn)
    return Built(fns, [*theirs.parameters(), *ours.parameters()])


# The CUDA layers' shape (batch, d_model, heads, d_ff), and the encoder's second one: the study notes' d512 layer at
# batch 16, whose speed against torch.nn the thin path's issue names as a target.
GPU_LAYER, GPU_ENCODER_D512 = (8, 1024, 16, 4096), (16, 512, 8, 2048)


def _layer_cases(setup: Setup, lengths: Sequence[int], decoder: bool) -> Iterator[Case]:
    gpu = setup.device.type == "cuda"
    shape = GPU_LAYER if gpu else (16, 256, 8, 1024)
    suite = "decoder_layer" if decoder else "encoder_layer"
    variants = [("no padding", 0.0, False, shape), ("pad50%", 0.5, False, shape)]
    if not decoder:  # the encoder packs real tokens under a padding mask: what it pays grows with them
        variants += [("pad25%", 0.25, False, shape), ("pad75%", 0.75, False, shape), ("seq-first", 0.0, True, shape)]
        if gpu:
            variants.append(("d512 B16", 0.0, False, GPU_ENCODER_D512))
    for case, padding, seq_first, (batch, d_model, heads, d_ff) in variants:
        for mode in ("train", "eval"):
            for length in lengths:
                kept = kept_lengths(batch, length, padding)
                yield Case(
                    suite, case, mode, length, batch, ("torch.nn", "ours"), heads=heads,
                    head_dim=d_model // heads, d_model=d_model, d_ff=d_ff, causal=decoder or seq_first,
                    padding=padding_ratio(kept, length),
                    build=functools.partial(_build_layer, setup, decoder, batch, length, d_model, heads, d_ff,
                                            kept if padding else None, mode == "train", seq_first),
                )


DECODE_MODEL = dict(hid_dim=256, n_layers=3, n_heads=8, ff_dim=512, dropout=0.1)  # the study notes' size
DECODE_VOCAB = 1000


def _build_decode_step(setup: Setup, batch: int, length: int) -> Built:
    """One cached decoding step after a prefix of ``length - 1`` target tokens; each timed call rewinds the
    cache to that prefix, so every call does the same work."""
    from fused_transformer.models import Seq2SeqTransformer

    torch.manual_seed(0)
    ours = Seq2SeqTransformer(DECODE_VOCAB, DECODE_VOCAB, max_len=length + 1, **DECODE_MODEL)
    models = {"torch.nn": Seq2SeqTransformer.torch_nn_twin(ours), "ours": ours}
    src = torch.randint(3, DECODE_VOCAB, (batch, length), device=setup.device)
    prefix = torch.randint(3, DECODE_VOCAB, (batch, length - 1), device=setup.device)
    token = torch.randint(3, DECODE_VOCAB, (batch, 1), device=setup.device)
    fns = {}
    for name, model in models.items():
        model.to(device=setup.device, dtype=setup.dtype).eval()
        with torch.no_grad(), ft.use_backend(setup.backend):
            memory, src_padding = model.encode(src)
            cache = model.start_cache(memory, src_padding, capacity=length)
            model.decode_step(prefix, cache)

        def step(model=model, cache=cache) -> Tensor:
            cache.length = length - 1
            return model.decode_step(token, cache)

        fns[name] = _forward(_on_backend(setup.backend, step) if name == "ours" else step)
    return Built(fns)


def decode_step_cases(setup: Setup, lengths: Sequence[int]) -> Iterator[Case]:
    batch = 32
    for length in lengths:
        yield Case("decode_step", "greedy step", "eval", length, batch, ("torch.nn", "ours"),
                   heads=DECODE_MODEL["n_heads"], head_dim=DECODE_MODEL["hid_dim"] // DECODE_MODEL["n_heads"],
                   d_model=DECODE_MODEL["hid_dim"], d_ff=DECODE_MODEL["ff_dim"], causal=True, new_tokens=batch,
                   build=functools.partial(_build_decode_step, setup, batch, length))


DECODE_HEADS = ((8, 8), (32, 8))  # (query heads, KV heads): plain and grouped-query, head dim 64 (128 on CUDA)


def _build_decode(setup: Setup, impls: Tuple[str, ...], batch: int, length: int, heads: int, kv_heads: int,
                  head_dim: int) -> Built:
    """One decoding step on a contiguous cache holding ``length - 1`` keys: append the new key and value, then attend
    with one query per sequence. SDPA gets the same cache, written with the same new key, sliced to ``length``."""
    torch.manual_seed(0)
    k_cache, v_cache = (_randn(setup, batch, length, kv_heads, head_dim) for _ in range(2))
    q = _randn(setup, batch, 1, heads, head_dim)
    k_new, v_new = (_randn(setup, batch, 1, kv_heads, head_dim) for _ in range(2))
    lengths = torch.full((batch,), length - 1, dtype=torch.int32, device=setup.device)
    host_lengths = lengths.cpu()  # ours checks the lengths it is given on the host without waiting for the GPU

    def sdpa() -> Tensor:
        k_cache[:, length - 1:] = k_new
        v_cache[:, length - 1:] = v_new
        return F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                              enable_gqa=heads != kv_heads).transpose(1, 2)

    calls: Dict[str, Callable[[], Tensor]] = {
        "sdpa": sdpa,
        "ours": _on_backend(setup.backend, lambda: ft.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=host_lengths, k_new=k_new, v_new=v_new)),
    }
    if "flash_attn" in impls:
        calls["flash_attn"] = lambda: third_party("flash_attn").flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths, causal=True)
    return Built({name: _forward(calls[name]) for name in impls})


def decode_cases(setup: Setup, lengths: Sequence[int]) -> Iterator[Case]:
    gpu = setup.device.type == "cuda"
    head_dim = 128 if gpu else 64
    impls = ("sdpa", "ours")
    if gpu and third_party("flash_attn") is not None:
        impls += ("flash_attn",)
    for batch in (1, 8, 32, 128) if gpu else (1, 8, 32):
        for heads, kv_heads in DECODE_HEADS:
            for length in lengths:
                cache_bytes = 2.0 * batch * length * kv_heads * head_dim * setup.dtype.itemsize
                yield Case("decode", f"B{batch} H{heads}/{kv_heads}", "eval", length, batch, impls, heads=heads,
                           head_dim=head_dim, causal=True, new_tokens=batch, nbytes=cache_bytes,
                           build=functools.partial(_build_decode, setup, impls, batch, length, heads, kv_heads,
                                                   head_dim))


MODULE_CALL_SHAPE = dict(batch=2, d_model=32, heads=4, d_ff=64)
MODULE_CALL_MODULES = {  # case label -> the class, in torch.nn and in fused_transformer
    "LayerNorm": "LayerNorm", "MHA": "MultiheadAttention", "encoder layer": "TransformerEncoderLayer",
    "decoder layer": "TransformerDecoderLayer",
}


def module_twins(setup: Setup, name: str, d_model: int, heads: int, d_ff: int) -> Tuple[nn.Module, nn.Module]:
    """``torch.nn``'s module ``name`` and ours holding the same weights (dropout ``DROPOUT``, batch_first)."""
    torch.manual_seed(0)
    factory = dict(device=setup.device, dtype=setup.dtype)
    args = {"LayerNorm": (d_model,), "MultiheadAttention": (d_model, heads)}.get(name, (d_model, heads, d_ff))
    kwargs = {} if name == "LayerNorm" else dict(dropout=DROPOUT, batch_first=True)
    theirs = getattr(nn, name)(*args, **kwargs, **factory)
    ours = getattr(ft, name)(*args, **kwargs, **factory)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def module_call(module: nn.Module, name: str, x: Tensor) -> Callable[[], Tensor]:
    """One call of ``module`` (a ``module_twins`` module) on ``x`` ``[B, L, d_model]``: self-attention, the decoder
    attending to ``x`` as its memory."""
    if name == "MultiheadAttention":
        return lambda: module(x, x, x, need_weights=False)[0]
    if name == "TransformerDecoderLayer":
        return lambda: module(x, x)
    return lambda: module(x)


def module_calls(theirs: nn.Module, ours: nn.Module, name: str, x: Tensor,
                 train: bool) -> Dict[str, Callable[[], Tensor]]:
    """``{"torch.nn": call, "ours": call}`` of the ``module_twins`` on ``x``, in training mode or not."""
    for module in (theirs, ours):
        module.train(train)
    return {"torch.nn": module_call(theirs, name, x), "ours": module_call(ours, name, x)}


def _build_module_call(setup: Setup, name: str, length: int, train: bool) -> Built:
    batch, d_model, heads, d_ff = (MODULE_CALL_SHAPE[k] for k in ("batch", "d_model", "heads", "d_ff"))
    theirs, ours = module_twins(setup, name, d_model, heads, d_ff)
    x, grad = _randn(setup, batch, length, d_model, grad=train), _randn(setup, batch, length, d_model)
    fns = module_calls(theirs, ours, name, x, train)
    fns["ours"] = _on_backend(setup.backend, fns["ours"])
    fns = {impl: _forward_backward(fn, grad) if train else _forward(fn) for impl, fn in fns.items()}
    return Built(fns, [x, *theirs.parameters(), *ours.parameters()])


def module_call_cases(setup: Setup, lengths: Sequence[int]) -> Iterator[Case]:
    shape = MODULE_CALL_SHAPE
    for label, name in MODULE_CALL_MODULES.items():
        for mode in ("eval", "train"):
            for length in lengths:
                yield Case("module_call", label, mode, length, shape["batch"], ("torch.nn", "ours"),
                           heads=None if name == "LayerNorm" else shape["heads"],
                           head_dim=None if name == "LayerNorm" else shape["d_model"] // shape["heads"],
                           d_model=shape["d_model"], d_ff=shape["d_ff"] if name.endswith("Layer") else None,
                           build=functools.partial(_build_module_call, setup, name, length, mode == "train"))


CASES: Dict[str, Callable[[Setup, Sequence[int]], Iterator[Case]]] = {
    "attention": attention_cases,
    **{op.name: functools.partial(op_cases, op) for op in ops.registered()},
    "encoder_layer": functools.partial(_layer_cases, decoder=False),
    "decoder_layer": functools.partial(_layer_cases, decoder=True),
    "decode_step": decode_step_cases,
    "decode": decode_cases,
    "module_call": module_call_cases,
}


def describe(suite: str, setup: Setup) -> str:
    """The shapes a suite runs on this device, in words (for the table's header)."""
    gpu = setup.device.type == "cuda"
    if suite == "attention":
        if gpu:
            return (f"batch {GPU_ATTENTION_TOKENS} / L (at least 2), 2048 / D heads, D 64 and 128, "
                    f"dropout 0")
        return "batch 8, 8 heads, D 64, dropout 0"
    if suite in ops.names():
        return ops.get(suite).describe(gpu)
    if suite == "module_call":
        shape = MODULE_CALL_SHAPE
        return (f"batch {shape['batch']}, d_model {shape['d_model']}, {shape['heads']} heads, d_ff {shape['d_ff']}, "
                f"dropout {DROPOUT}: one call of a module on a tiny input, its per-call overhead")
    if suite == "decode":
        return (f"one decoding step (1 query per sequence, the new key appended first) on a contiguous cache of L "
                f"keys, head dim {128 if gpu else 64}, KV heads 8, query heads 8 and 32; GB/s counts the cache read")
    if suite == "decode_step":
        return ("batch 32, Seq2Seq d 256, 3 + 3 layers, 8 heads, ff 512, one cached token per sequence after L - 1, "
                "source L")
    dims = "batch 8, d_model 1024, 16 heads, d_ff 4096" if gpu else "batch 16, d_model 256, 8 heads, d_ff 1024"
    causal = ", causal self-attention, memory as long as the target" if suite == "decoder_layer" else ""
    return f"{dims}, dropout {DROPOUT}{causal}"


def default_lengths(suite: str, device: torch.device, quick: bool) -> Tuple[int, ...]:
    kind = "cuda" if device.type == "cuda" else "cpu"
    full, short = ops.get(suite).lengths[kind] if suite in ops.names() else LENGTHS[(kind, suite)]
    return short if quick else full


def cases(suite: str, setup: Setup, lengths: Optional[Sequence[int]] = None, quick: bool = False) -> List[Case]:
    """Every case of ``suite`` on ``setup``, over ``lengths`` (default: the suite's lengths for this device)."""
    if suite not in CASES:
        raise ValueError(f"suite={suite!r} is not one of {', '.join(SUITES)}")
    return list(CASES[suite](setup, lengths or default_lengths(suite, setup.device, quick)))


def is_competitor(impl: str) -> bool:
    """Implementations allowed to refuse a case (left out of it with a note) rather than fail the run."""
    return impl.startswith("sdpa:") or impl in ("flash_attn", "xformers")
