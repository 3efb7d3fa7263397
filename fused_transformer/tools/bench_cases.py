"""The benchmark suites: every case that ``python -m fused_transformer bench`` and ``pytest benchmarks/`` measure,
the implementations compared in each, the work counted, and how time and memory are measured.

Suites (``SUITES``), each over sequence lengths:

- every registered op with a bench (``fused_transformer.ops``: ``Op.bench``, its suite ``Op.bench_suite``): the op's
  examples in each of its ``Op.bench_modes`` (``fwd`` under ``no_grad``, ``fwd+bwd`` a call and its backward, ``eval``
  under ``no_grad``), ours (the public function on the chosen backend, and ``ours:triton`` on CUDA under ``auto``)
  against its baseline (``Op.baseline``: its torch path, or the call its rivals prepare, as SDPA given its masks in
  its own form) and its rivals (``Op.rivals``: SDPA's backends, FlashAttention, xFormers where the op has them,
  prepared outside the timed calls). The op says what its suite runs (``Op.describe``), at which lengths
  (``Op.lengths``) and what a case counts (``Op.work``). The ops timed with their backward come first; those timed
  in inference only (attention's decoding step, ``decode``) after the ``decode_step`` suite.
- ``encoder_layer`` / ``decoder_layer``: ``ft.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` against the
  ``torch.nn`` layer holding the same weights (dropout 0.1, batch_first, post-norm); a training step (forward +
  backward) and an eval forward under ``no_grad`` (torch.nn then takes its fast path), without padding and
  with 50% key padding; the decoder self-attention is causal and its memory has the target's length. The
  encoder also runs seq-first (``batch_first=False``, torch.nn's default) with a causal float mask, as the
  PyTorch examples' word-language model does.
- ``llama``: a Llama model of Hugging Face transformers, ``ft.fuse``'d against transformers' own: a decoder layer's
  forward + backward and a training step (``fused_transformer.tools.bench_llama``; none without transformers).
- ``decode_step``: one cached greedy-decoding step (a token per sequence) of the study notes' Seq2Seq model
  (``fused_transformer.models``, d 256, 3 + 3 layers, 8 heads, ff 512) against its torch.nn twin on the same
  weights, after a prefix of L - 1 target tokens over a source of L tokens; tokens/s counts one token per
  sequence.
- ``module_call``: one call of ``ft.LayerNorm``, ``MultiheadAttention`` (``need_weights=False``), and the encoder and
  decoder layers on a tiny input (batch 2, L 4, d_model 32, 4 heads, d_ff 64), eval under ``no_grad`` and a training
  step, against the ``torch.nn`` module with the same weights: at this size the time is almost all per-call Python
  and dispatch overhead, which a one-token decoding step or a small-batch model pays on every module.

"ours" runs on the ``auto`` backend: the C++ kernels for CPU tensors, Triton for CUDA tensors.

Padding (the layers' and attention's): sequences alternately keep ``1 - 3p/2`` and ``1 - p/2`` of their keys (p =
0.5: a quarter and three quarters), right-padded, so a padding ratio p removes the fraction p of the keys of a batch
(``fused_transformer.ops.attention.cases.kept_lengths``).

Work counted: the op's ``Op.work``; rates from it in ``bench_work``. Time and peak memory: ``bench_timing``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

import fused_transformer as ft
from fused_transformer import ops
from fused_transformer.ops.attention.cases import kept_lengths, padding_ratio

# suite -> the op it times, in the order the ops registered; the suites of the ops timed with their backward
OP_SUITES: Dict[str, ops.Op] = {op.bench_suite: op for op in ops.registered() if op.bench_suite is not None}
TRAINED = tuple(suite for suite, op in OP_SUITES.items() if "fwd+bwd" in op.bench_modes)
SUITES = (*TRAINED, "encoder_layer", "decoder_layer", "llama", "decode_step",
          *(suite for suite in OP_SUITES if suite not in TRAINED), "module_call")
DROPOUT = 0.1
# "ours" as a user calls it (on "auto", routed to torch's path where the route table measured it faster), and on CUDA
# under "auto" "ours:triton", our kernel whatever the route.
OURS = ("ours", "ours:triton")

# Default sequence lengths of the module suites: (device type, suite) -> (full, --quick); an op's are its
# ``Op.lengths``.
LENGTHS = {
    ("cpu", "encoder_layer"): ((128, 256, 512), (128,)),
    ("cpu", "decoder_layer"): ((128, 256, 512), (128,)),
    ("cpu", "decode_step"): ((16, 64, 128), (16,)),
    ("cpu", "module_call"): ((4,), (4,)),
    ("cuda", "encoder_layer"): ((512, 1024, 2048, 4096), (1024, 4096)),
    ("cuda", "decoder_layer"): ((512, 1024, 2048, 4096), (1024, 4096)),
    ("cuda", "decode_step"): ((64, 256, 1024), (256,)),
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
    # The implementations whose UserWarnings are silenced: SDPA warns about each backend that refuses a case, which the
    # table already says.
    quiet: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Case:
    """One measurement point; ``build()`` allocates its tensors (call it when about to time it)."""

    suite: str
    case: str  # mask or shape label, e.g. "causal", "pad50%", "d1024"
    mode: str  # "fwd", "fwd+bwd", "eval" (ops: ``Op.bench_modes``), "train", "eval" (layers)
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
    by_head_dim: bool = False  # the suite's cases differ by head dim too (``keyed_by_head_dim``): the id says it

    @property
    def baseline(self) -> str:
        return self.impls[0]

    @property
    def tokens(self) -> int:
        return self.new_tokens if self.new_tokens is not None else self.batch * self.seq_len

    @property
    def id(self) -> str:
        head_dim = f"-D{self.head_dim}" if self.by_head_dim else ""
        return f"{self.suite}-{self.case.replace(' ', '_')}-{self.mode}-L{self.seq_len}{head_dim}"


# --------------------------------------------------------------------------------------------- builders


def _forward(fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
    def run() -> Tensor:
        with torch.no_grad():
            return fn()
    return run


def _forward_backward(fn: Callable[[], Tensor], grad: Tensor) -> Callable[[], None]:
    """``fn`` and its backward from ``grad`` (a tuple of gradients for an op that returns a tuple)."""
    def run() -> None:
        torch.autograd.backward(fn(), grad)
    return run


def random_like(out: object) -> object:
    """Random numbers shaped as an op's output: a tensor, or a tuple of them for an op that returns several."""
    return tuple(map(torch.randn_like, out)) if isinstance(out, tuple) else torch.randn_like(out)


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


# ------------------------------------------------------------------------------------------------ the ops


def _build_op(setup: Setup, op: ops.Op, example: ops.Example, impls: Tuple[str, ...], backward: bool) -> Built:
    """An op's example: ours (its public function) against its baseline and rivals, on the same tensors."""
    torch.manual_seed(0)
    tensors = example.draw(lambda *shape, scale=1.0: _randn(setup, *shape, scale=scale))
    tensors = {name: t.float() if name in op.float32 and t is not None and t.is_floating_point() else t
               for name, t in tensors.items()}
    leaves = [t.requires_grad_(backward) for t in op.differentiated(tensors)]
    rival_calls = op.rivals.calls(example, tensors, [name for name in impls if name not in OURS + (op.baseline,)],
                                  backward)

    def ours() -> object:
        return op.function(**tensors, **example.options)

    calls = {op.baseline: rival_calls.calls.get(op.baseline, lambda: op.torch_path(**tensors, **example.options)),
             "ours": _on_backend(setup.backend, ours), "ours:triton": _on_backend("triton", ours),
             **{name: call for name, call in rival_calls.calls.items() if name != op.baseline}}
    leaves += rival_calls.leaves
    built = Built({}, leaves, dict(rival_calls.notes), tuple(rival_calls.calls))
    if not backward:
        built.fns = {name: _forward(calls[name]) for name in impls}
        return built
    with torch.no_grad():
        grad = random_like(calls[op.baseline]())
    for name in impls:
        made = rival_calls.grads.get(name)
        built.fns[name] = _forward_backward(calls[name], made(grad) if made is not None else grad)
    return built


@functools.lru_cache(maxsize=None)
def keyed_by_head_dim(suite: str) -> bool:
    """Whether ``suite``'s cases differ by head dim too: an op's whose examples hold several head dims on a device
    (attention's, 64 and 128 on CUDA). Its case ids and gpu-check's tables show the head dim, on every device alike."""
    op = OP_SUITES.get(suite)
    if op is None:
        return False
    for kind in ("cpu", "cuda"):
        lengths = op.lengths[kind][1] if kind in op.lengths else (128,)
        if len({example.shape.get("head_dim") for example in op.bench(kind == "cuda", lengths)}) > 1:
            return True
    return False


def op_cases(op: ops.Op, setup: Setup, lengths: Sequence[int]) -> Iterator[Case]:
    """An op's bench cases (``Op.bench``) in each of its modes (``Op.bench_modes``), by label (and head dim)."""
    gpu = setup.device.type == "cuda"
    suite, by_head_dim = op.bench_suite, keyed_by_head_dim(op.bench_suite)
    examples = op.bench(gpu, lengths)
    groups = dict.fromkeys((example.label, example.shape.get("head_dim")) for example in examples)
    for key in groups:
        for mode in op.bench_modes:
            for example in (e for e in examples if (e.label, e.shape.get("head_dim")) == key):
                backward = mode == "fwd+bwd"
                impls = (op.baseline, *(OURS if gpu and setup.backend == "auto" else OURS[:1]),
                         *op.rivals.names(example, setup.device))
                shape = example.shape
                work = op.work(example, setup.dtype.itemsize, backward)
                yield Case(suite, example.label, mode, shape["seq_len"], shape["batch"], impls,
                           heads=shape.get("heads"), head_dim=shape.get("head_dim"), d_model=shape.get("d_model"),
                           d_ff=shape.get("d_ff"), causal=bool(shape.get("causal", False)),
                           padding=shape.get("padding", 0.0), flops=work.flops, nbytes=work.nbytes,
                           new_tokens=shape.get("tokens"), by_head_dim=by_head_dim,
                           build=functools.partial(_build_op, setup, op, example, impls, backward))


# --------------------------------------------------------------------------------------------- the layers


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


def _llama_cases(setup: Setup, lengths: Sequence[int]) -> Iterator[Case]:
    from fused_transformer.tools import bench_llama  # it imports this module, and transformers

    return bench_llama.cases(setup, lengths)


CASES: Dict[str, Callable[[Setup, Sequence[int]], Iterator[Case]]] = {
    **{suite: functools.partial(op_cases, op) for suite, op in OP_SUITES.items()},
    "encoder_layer": functools.partial(_layer_cases, decoder=False),
    "decoder_layer": functools.partial(_layer_cases, decoder=True),
    "decode_step": decode_step_cases,
    "module_call": module_call_cases,
    "llama": _llama_cases,
}


def describe(suite: str, setup: Setup) -> str:
    """The shapes a suite runs on this device, in words (for the table's header)."""
    gpu = setup.device.type == "cuda"
    if suite in OP_SUITES:
        return OP_SUITES[suite].describe(gpu)
    if suite == "module_call":
        shape = MODULE_CALL_SHAPE
        return (f"batch {shape['batch']}, d_model {shape['d_model']}, {shape['heads']} heads, d_ff {shape['d_ff']}, "
                f"dropout {DROPOUT}: one call of a module on a tiny input, its per-call overhead")
    if suite == "llama":
        from fused_transformer.tools import bench_llama

        return bench_llama.describe(setup)
    if suite == "decode_step":
        return ("batch 32, Seq2Seq d 256, 3 + 3 layers, 8 heads, ff 512, one cached token per sequence after L - 1, "
                "source L")
    dims = "batch 8, d_model 1024, 16 heads, d_ff 4096" if gpu else "batch 16, d_model 256, 8 heads, d_ff 1024"
    causal = ", causal self-attention, memory as long as the target" if suite == "decoder_layer" else ""
    return f"{dims}, dropout {DROPOUT}{causal}"


def default_lengths(suite: str, device: torch.device, quick: bool) -> Tuple[int, ...]:
    kind = "cuda" if device.type == "cuda" else "cpu"
    if suite == "llama":
        from fused_transformer.tools import bench_llama

        full, short = bench_llama.LENGTHS[kind]
        return short if quick else full
    full, short = OP_SUITES[suite].lengths[kind] if suite in OP_SUITES else LENGTHS[(kind, suite)]
    return short if quick else full


def cases(suite: str, setup: Setup, lengths: Optional[Sequence[int]] = None, quick: bool = False) -> List[Case]:
    """Every case of ``suite`` on ``setup``, over ``lengths`` (default: the suite's lengths for this device)."""
    if suite not in CASES:
        raise ValueError(f"suite={suite!r} is not one of {', '.join(SUITES)}")
    return list(CASES[suite](setup, lengths or default_lengths(suite, setup.device, quick)))


def unavailable_reason(suite: str) -> Optional[str]:
    """Why ``suite`` cannot run here (``llama`` without transformers), or None: bench says so and skips it."""
    if suite != "llama":
        return None
    from fused_transformer.tools import bench_llama

    return bench_llama.unavailable_reason()


def is_competitor(impl: str, suite: Optional[str] = None) -> bool:
    """Whether ``impl`` may refuse a case (left out of it with a note) rather than fail the run: a rival of an op
    (of ``suite``'s op when given) that says so (``Rivals.may_refuse``)."""
    found = OP_SUITES.values() if suite is None else [OP_SUITES[suite]] if suite in OP_SUITES else []
    return any(op.rivals.may_refuse(impl) for op in found)


def competitor_notes(device: torch.device, suites: Optional[Sequence[str]] = None) -> List[str]:
    """What the ops of ``suites`` (default: every op's) are measured against, and what is left out and why
    (``Rivals.about``): to print loudly before a run."""
    found = [op for suite, op in OP_SUITES.items() if suites is None or suite in suites]
    return list(dict.fromkeys(note for op in found for note in op.rivals.about(device)))
