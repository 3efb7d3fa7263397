"""The variants suite (``bench --suite variants``): every variant of every kernel that has some
(``fused_transformer.kernels.variants``), timed side by side on the bench's shapes against the vendor's kernel, and
the fastest per GPU and shape class written as the rows the plans read.

Per op, on CUDA (bfloat16):

- ``attention.fwd``: our forward kernel (``kernels.attention.attention``, whatever the route says) under
  ``no_grad``, head dims 64 and 128, no mask and causal, L 1024, 4096 and 16384 (``--quick``: 4096), 16k tokens a
  batch and 2048 / D heads as the attention suite; against SDPA's cuDNN backend (``sdpa:cudnn_attention``).
  ``attention.bwd``: the same shapes forward + backward, the variant applied to the backward's two kernels.
- each registered op's kernel variants (``Op.variants``: the norms' ``.fwd`` / ``.bwd`` with a residual, no dropout:
  the kernels' own speed), the op on the Triton backend on its examples; against its torch path.
- ``decode.split``: one decoding step of ``attention_with_kvcache`` (one query per sequence, 8 KV heads of 32 query
  heads, head dim 128) on caches of 8192 and 32768 keys, batch 1 and 8 (where the rules' split counts differ);
  against SDPA on the same cache.

An implementation ``variant:NAME`` runs the op with ``variants.forced({op: NAME})``; the variants whose plan changes
nothing for a case (``deep_pipeline`` off sm_90, say) are left out of it. Before timing, every variant's output is
compared with the default's: one that differs by more than the precision allows fails its case (and never wins).
The rows (``VariantRow``) go to ``--variant-rows`` (default: the package's ``kernels/variant_rows.json`` on CUDA,
``DIR/variant_rows_cpu.json`` on the CPU).

On the CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``) on one tiny case per op: that the
suite runs and each variant agrees with the default, not their speed.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import subprocess
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fused_transformer import ops
from fused_transformer.kernels import variants
from fused_transformer.kernels.variants import VariantRow
from fused_transformer.ops.attention.cases import attention_flops
from fused_transformer.tools.bench_cases import Built, Case, Setup, _forward, _forward_backward

SUITE = "variants"
PREFIX = "variant:"
GPU_TOKENS = 16384
# The sizes each op's cases run at: by (on CUDA, --quick), or by on CUDA.
ATTENTION_LENGTHS = {(True, False): (1024, 4096, 16384), (True, True): (4096,), (False, False): (40,),
                     (False, True): (40,)}
DECODE_KEYS = {True: (8192, 32768), False: (512,)}
DECODE_BATCHES = {True: (1, 8), False: (2,)}  # from 32 x 8 KV heads the grid fills an H100 without splits
# How far a variant's output may lie from the default's, relative to the default's largest magnitude: the variants
# change the order of the key tiles' sums at most (bfloat16 outputs round at 2**-8).
AGREEMENT = {torch.bfloat16: 2 ** -6, torch.float16: 2 ** -8, torch.float32: 1e-4}


def unusable_reason(setup: Setup) -> Optional[str]:
    """Why the suite cannot run on ``setup`` (None when it can): our Triton kernels need a GPU or the interpreter."""
    from fused_transformer.kernels._common import interpreting

    if setup.device.type != "cuda" and not interpreting():
        return ("the variants time our Triton kernels: give --device cuda, or run the CPU's tiny case under the "
                "Triton interpreter (TRITON_INTERPRET=1)")
    return None


def impl_name(variant: str) -> str:
    return PREFIX + variant


def _variant_calls(op: str, names: Sequence[str], call: Callable[[], Tensor]) -> Dict[str, Callable[[], Tensor]]:
    """``call`` run in each variant ``names`` of ``op``, by implementation name."""
    def forced(name: str) -> Callable[[], Tensor]:
        def run() -> Tensor:
            with variants.forced({op: name}):
                return call()
        return run
    return {impl_name(name): forced(name) for name in names}


def _agreeing(op: str, calls: Dict[str, Callable[[], object]], checks: Dict[str, Callable[[], object]],
              default: str, dtype: torch.dtype) -> Dict[str, Callable[[], object]]:
    """``calls`` with each variant whose ``checks`` call (its outputs, a tensor or a tuple of them) disagrees with the
    default's replaced by one that raises why, so that its case records the failure and it wins nothing."""
    def outputs(call: Callable[[], object]) -> Tuple[Tensor, ...]:
        got = call()
        return got if isinstance(got, tuple) else (got,)

    expected = outputs(checks[impl_name(default)])
    checked = dict(calls)
    for impl, check in checks.items():
        worst = max(float((g.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-30))
                    for g, e in zip(outputs(check), expected))
        if not worst <= AGREEMENT[dtype]:
            def refuse(impl: str = impl, worst: float = worst) -> object:
                raise ValueError(f"{op} {impl} differs from the default by {worst:.2e} of its largest value "
                                 f"(allowed {AGREEMENT[dtype]:.0e})")
            checked[impl] = refuse
    return checked


# ------------------------------------------------------------------------------------------- attention.fwd


def attention_variants(setup: Setup, op: str, head_dim: int, length: int, batch: int, heads: int) -> List[str]:
    """The buildable variants of ``op`` ("attention.fwd", "attention.bwd") whose plan differs on this launch from the
    default's (the default first)."""
    from fused_transformer.kernels.attention import configs
    from fused_transformer.kernels.attention.launch import launch_target

    target = launch_target(setup.device)
    tma = batch * heads * length * length >= configs.TMA_MIN_SCORES  # the inputs are fresh: TMA addresses them
    kernels = ("fwd",) if op == "attention.fwd" else ("bwd_dq", "bwd_dkdv")
    default, refusals = variants.registered()[op]
    names = [default]
    for name, refused in refusals.items():
        if name != default and not refused and any(
                configs.plan(kernel, setup.dtype, head_dim, target, tma_addressable=tma, scores_only=True,
                             variant=name).variant == name for kernel in kernels):
            names.append(name)
    return names


def _build_attention(setup: Setup, op: str, names: Tuple[str, ...], batch: int, heads: int, length: int,
                     head_dim: int, causal: bool) -> Built:
    from fused_transformer.kernels.attention import attention as kernel_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    backward = op == "attention.bwd"
    q, k, v = (torch.randn(batch, heads, length, head_dim, device=setup.device, dtype=setup.dtype,
                           requires_grad=backward) for _ in range(3))
    grad = torch.randn_like(q)
    calls = _variant_calls(op, names, lambda: kernel_attention(q, k, v, is_causal=causal))
    if backward:
        checks = {impl: (lambda call=call: torch.autograd.grad(call(), (q, k, v), grad))
                  for impl, call in calls.items()}
    else:
        checks = {impl: _forward(call) for impl, call in calls.items()}
    calls = _agreeing(op, calls, checks, names[0], setup.dtype)

    def vendor() -> Tensor:
        if setup.device.type != "cuda":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    fns = {vendor_name(setup, op): vendor, **calls}
    if backward:
        return Built({impl: _forward_backward(fn, grad) for impl, fn in fns.items()}, [q, k, v])
    return Built({impl: _forward(fn) for impl, fn in fns.items()})


def attention_cases(setup: Setup, quick: bool) -> Iterator[Case]:
    from fused_transformer.kernels.attention import configs

    gpu = setup.device.type == "cuda"
    if not gpu:  # the variants serve 16-bit launches: the interpreter's tiny case is one
        setup = dataclasses.replace(setup, dtype=torch.bfloat16)
    for op in ("attention.fwd", "attention.bwd"):
        backward = op == "attention.bwd"
        for head_dim in (64, 128) if gpu else (64,):
            for causal in (False, True):
                for length in ATTENTION_LENGTHS[(gpu, quick)]:
                    batch, heads = (max(GPU_TOKENS // length, 1), 2048 // head_dim) if gpu else (2, 2)
                    names = tuple(attention_variants(setup, op, head_dim, length, batch, heads))
                    if len(names) < 2:
                        continue
                    shape = configs.shape_class(setup.dtype, head_dim, length, causal, True)
                    yield Case(
                        SUITE, f"{op} {shape}", "fwd+bwd" if backward else "fwd", length, batch,
                        (vendor_name(setup, op), *map(impl_name, names)), heads=heads, head_dim=head_dim,
                        d_model=heads * head_dim, causal=causal, padding=0.0,
                        flops=attention_flops(batch, heads, length, head_dim, causal=causal, kept=None,
                                              backward=backward),
                        build=functools.partial(_build_attention, setup, op, names, batch, heads, length, head_dim,
                                                causal),
                    )


# ---------------------------------------------------------------------------------- the registered ops


def _build_op(setup: Setup, op: ops.Op, cases: ops.VariantCases, names: Tuple[str, ...],
              example: ops.Example) -> Built:
    """A registered op's example on the Triton backend under each variant, against its torch path."""
    import fused_transformer as ft

    torch.manual_seed(0)
    tensors = example.draw(lambda *shape, scale=1.0: torch.randn(*shape, device=setup.device,
                                                                 dtype=setup.dtype) * scale)
    leaves = [t.requires_grad_(cases.backward) for t in tensors.values() if t is not None]

    def ours() -> Tensor:
        with ft.use_backend("triton"):
            return op.function(**tensors, **example.options)

    def vendor() -> Tensor:
        return op.torch_path(**tensors, **example.options)

    calls = _variant_calls(cases.variant_op, names, ours)
    grad = torch.randn_like(vendor()) if cases.backward else None
    if cases.backward:
        def gradients(call: Callable[[], Tensor]) -> Callable[[], Tuple[Tensor, ...]]:
            def run() -> Tuple[Tensor, ...]:
                return torch.autograd.grad(call(), leaves, grad)
            return run
        checks = {impl: gradients(call) for impl, call in calls.items()}
    else:
        checks = {impl: _forward(call) for impl, call in calls.items()}
    calls = _agreeing(cases.variant_op, calls, checks, names[0], setup.dtype)
    fns = {vendor_name(setup, cases.variant_op): vendor, **calls}
    if cases.backward:
        return Built({impl: _forward_backward(fn, grad) for impl, fn in fns.items()}, leaves)
    return Built({impl: _forward(fn) for impl, fn in fns.items()})


def op_cases(setup: Setup, quick: bool) -> Iterator[Case]:
    """The variants of every registered op's kernels (``Op.variants``) on their examples."""
    gpu = setup.device.type == "cuda"
    for op in ops.registered():
        for cases in op.variants:
            if cases.variant_op not in variants.registered():
                continue
            default, refusals = variants.registered()[cases.variant_op]
            names = (default, *(name for name, reason in refusals.items() if name != default and not reason))
            for example in cases.examples(gpu, quick):
                shape = example.shape
                work = op.work(example, setup.dtype.itemsize, cases.backward)
                yield Case(
                    SUITE, f"{cases.variant_op} {cases.shape_class(example, setup.dtype)}",
                    "fwd+bwd" if cases.backward else "fwd", shape["batch"] * shape["seq_len"], 1,
                    (vendor_name(setup, cases.variant_op), *map(impl_name, names)), d_model=shape.get("d_model"),
                    flops=work.flops, nbytes=work.nbytes,
                    build=functools.partial(_build_op, setup, op, cases, names, example),
                )


# ------------------------------------------------------------------------------------------ decode.split


def _build_decode(setup: Setup, names: Tuple[str, ...], batch: int, keys: int, heads: int, kv_heads: int,
                  head_dim: int) -> Built:
    import fused_transformer as ft

    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(batch, keys, kv_heads, head_dim, device=setup.device, dtype=setup.dtype)
                        for _ in range(2))
    q = torch.randn(batch, 1, heads, head_dim, device=setup.device, dtype=setup.dtype)
    host_lengths = torch.full((batch,), keys, dtype=torch.int32)  # on the host: no call waits for the GPU

    def ours() -> Tensor:
        with ft.use_backend("triton"):
            return ft.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=host_lengths)

    calls = _variant_calls("decode.split", names, ours)
    calls = _agreeing("decode.split", calls, {impl: _forward(call) for impl, call in calls.items()}, names[0],
                      setup.dtype)

    def vendor() -> Tensor:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                              enable_gqa=heads != kv_heads).transpose(1, 2)

    return Built({impl: _forward(fn) for impl, fn in {vendor_name(setup, "decode.split"): vendor, **calls}.items()})


def decode_cases(setup: Setup, quick: bool) -> Iterator[Case]:
    """The decode cases where the split rules pick different split counts (elsewhere they launch the same grid)."""
    from fused_transformer.kernels.attention import decode
    from fused_transformer.kernels.attention.launch import sm_count_of

    if "decode.split" not in variants.registered():
        return
    gpu = setup.device.type == "cuda"
    default, refusals = variants.registered()["decode.split"]
    rules = (default, *(name for name, reason in refusals.items() if name != default and not reason))
    heads, kv_heads, head_dim = (32, 8, 128) if gpu else (4, 2, 16)
    tile = decode.decode_tile(heads // kv_heads, setup.dtype)
    for keys in DECODE_KEYS[gpu][:1] if quick else DECODE_KEYS[gpu]:
        for batch in DECODE_BATCHES[gpu]:
            splits = {rule: decode.decode_splits(batch, kv_heads, 1, keys, sm_count_of(setup.device), tile.block_n,
                                                 rule) for rule in rules}
            names = tuple(rule for rule in rules if rule == default or splits[rule] != splits[default])
            if len(names) < 2:
                continue
            yield Case(
                SUITE, f"decode.split {decode.shape_class(batch, kv_heads, keys)}", "fwd", keys, batch,
                (vendor_name(setup, "decode.split"), *map(impl_name, names)), heads=heads, head_dim=head_dim,
                nbytes=2.0 * batch * keys * kv_heads * head_dim * setup.dtype.itemsize,
                build=functools.partial(_build_decode, setup, names, batch, keys, heads, kv_heads, head_dim),
            )


# ------------------------------------------------------------------------------------------ the suite


def vendor_name(setup: Setup, op: str) -> str:
    """The baseline of ``op``'s cases: the vendor's kernel as the bench names it."""
    if op.startswith("attention"):
        return "sdpa:cudnn_attention" if setup.device.type == "cuda" else "sdpa"
    if op.startswith("decode"):
        return "sdpa"
    return "torch"  # a registered op's torch path


def cases(setup: Setup, quick: bool) -> List[Case]:
    """Every case of the suite on ``setup``."""
    from fused_transformer.kernels.aot import kernel_modules

    kernel_modules()  # the kernel modules register their variants on import
    return [*attention_cases(setup, quick), *op_cases(setup, quick), *decode_cases(setup, quick)]


def describe(setup: Setup) -> str:
    if setup.device.type == "cuda":
        return ("every variant of each op against the vendor's kernel: attention forward (16k tokens a batch, 2048 / D "
                "heads), each registered op's kernels (Op.variants), a decoding step's key splits")
    return "one tiny case per op under the Triton interpreter: that each variant runs and agrees, not its speed"


def _provenance(setup: Setup) -> str:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True, cwd=__file__.rsplit("/", 3)[0]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "no git"
    device = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "CPU (interpreter)"
    return (f"{device}, torch {torch.__version__}, triton {triton.__version__}, bench --suite variants at {commit}, "
            f"{datetime.date.today().isoformat()}")


def verdicts(rows: Sequence[Dict[str, object]], setup: Setup) -> List[VariantRow]:
    """The winner of every case of the suite's bench ``rows`` that timed its default variant: the fastest variant that
    agreed with it."""
    by_case: Dict[str, Dict[str, float]] = {}
    for row in rows:
        if row["suite"] == SUITE and row["ms"] is not None:
            by_case.setdefault(str(row["case"]), {})[str(row["impl"])] = float(row["ms"])
    gpu, provenance, found = variants.gpu_name(setup.device), _provenance(setup), []
    for case, times in by_case.items():
        op, shape = case.split(" ", 1)
        default = impl_name(variants.default_of(op))
        if default not in times:
            continue
        vendor = vendor_name(setup, op)
        ours = {impl: ms for impl, ms in times.items() if impl.startswith(PREFIX)}
        winner = min(ours, key=ours.get)
        found.append(VariantRow(op, gpu, shape, winner[len(PREFIX):], round(ours[winner] / times[default], 3),
                                round(times[vendor] / ours[winner], 3) if vendor in times else 0.0, vendor,
                                provenance))
    return found


def table(found: Sequence[VariantRow]) -> List[str]:
    """The verdicts as lines for the bench's output."""
    lines = [f"{'op':16} {'shape':28} {'winner':16} {'vs default':>10} {'vs vendor':>10}"]
    lines += [f"{row.op:16} {row.shape:28} {row.variant:16} {row.vs_default:10.3f} {row.vs_vendor:10.3f}"
              for row in found]
    return lines
