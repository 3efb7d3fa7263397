"""The variants suite (``bench --suite variants``): every variant of every kernel that has some
(``fused_transformer.kernels.variants``), timed side by side on the bench's shapes against the vendor's kernel, and
the fastest per GPU and shape class written as the rows the plans read.

Every registered op's kernel variants (``Op.variants``), the op on the Triton backend on its examples, against the
vendor's kernel (``VariantCases.vendor``; default the op's torch path). On CUDA (bfloat16):

- ``attention.fwd``: ``ft.attention`` on Triton under ``no_grad``, head dims 64 and 128, no mask and causal, L 1024,
  4096 and 16384 (``--quick``: 4096), 16k tokens a batch and 2048 / D heads as the attention suite; against SDPA's
  cuDNN backend (``sdpa:cudnn_attention``). ``attention.bwd``: the same shapes forward + backward, the variant
  applied to the backward's two kernels.
- the norms' ``.fwd`` / ``.bwd`` with a residual, no dropout (the kernels' own speed); against their torch path.
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
from torch import Tensor

from fused_transformer import ops
from fused_transformer.kernels import variants
from fused_transformer.kernels.variants import VariantRow
from fused_transformer.tools.bench_cases import Built, Case, Setup, _forward, _forward_backward

SUITE = "variants"
PREFIX = "variant:"
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


# ---------------------------------------------------------------------------------- the registered ops


def _build_op(setup: Setup, op: ops.Op, cases: ops.VariantCases, names: Tuple[str, ...],
              example: ops.Example) -> Built:
    """A registered op's example on the Triton backend under each variant, against the vendor's kernel."""
    import fused_transformer as ft

    torch.manual_seed(0)
    tensors = example.draw(lambda *shape, scale=1.0: torch.randn(*shape, device=setup.device,
                                                                 dtype=setup.dtype) * scale)
    tensors = {name: t.float() if name in op.float32 and t is not None else t for name, t in tensors.items()}
    leaves = [t.requires_grad_(cases.backward) for t in op.differentiated(tensors)]

    def ours() -> Tensor:
        with ft.use_backend("triton"):
            return op.function(**tensors, **example.options)

    vendor_impl, vendor_call = vendor_of(cases, op, setup.device)

    def vendor() -> Tensor:
        return vendor_call(**tensors, **example.options)

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
    fns = {vendor_impl: vendor, **calls}
    if cases.backward:
        return Built({impl: _forward_backward(fn, grad) for impl, fn in fns.items()}, leaves)
    return Built({impl: _forward(fn) for impl, fn in fns.items()})


def op_cases(setup: Setup, quick: bool) -> Iterator[Case]:
    """The variants of every registered op's kernels (``Op.variants``) on their examples: those whose launch differs
    from the default's (``VariantCases.choose``), a case where two at least do."""
    gpu = setup.device.type == "cuda"
    for op in ops.registered():
        for cases in op.variants:
            if cases.variant_op not in variants.registered():
                continue
            case_setup = setup if gpu or cases.dtype is None else dataclasses.replace(setup, dtype=cases.dtype)
            default, refusals = variants.registered()[cases.variant_op]
            buildable = (default, *(name for name, reason in refusals.items() if name != default and not reason))
            for example in cases.examples(gpu, quick):
                names = tuple(buildable if cases.choose is None else
                              cases.choose(example, setup.device, case_setup.dtype, buildable))
                if len(names) < 2:
                    continue
                shape = example.shape
                work = op.work(example, case_setup.dtype.itemsize, cases.backward)
                by_rows = "heads" not in shape  # a norm's example: its rows, one sequence
                yield Case(
                    SUITE, f"{cases.variant_op} {cases.shape_class(example, case_setup.dtype)}",
                    "fwd+bwd" if cases.backward else "fwd",
                    shape["batch"] * shape["seq_len"] if by_rows else shape["seq_len"], 1 if by_rows else shape["batch"],
                    (vendor_of(cases, op, setup.device)[0], *map(impl_name, names)), heads=shape.get("heads"),
                    head_dim=shape.get("head_dim"), d_model=shape.get("d_model"), causal=bool(shape.get("causal")),
                    flops=work.flops, nbytes=work.nbytes,
                    build=functools.partial(_build_op, case_setup, op, cases, names, example),
                )


# ------------------------------------------------------------------------------------------ the suite


def vendor_of(cases: ops.VariantCases, op: ops.Op, device: torch.device) -> Tuple[str, Callable[..., Tensor]]:
    """The vendor's kernel ``cases``' variants race, as the bench names it, and its call."""
    return cases.vendor(device) if cases.vendor is not None else ("torch", op.torch_path)


def vendor_name(setup: Setup, variant_op: str) -> str:
    """The baseline of ``variant_op``'s cases: the vendor's kernel as the bench names it."""
    for op in ops.registered():
        for cases in op.variants:
            if cases.variant_op == variant_op:
                return vendor_of(cases, op, setup.device)[0]
    raise ValueError(f"{variant_op!r} is no registered op's kernel variants")


def cases(setup: Setup, quick: bool) -> List[Case]:
    """Every case of the suite on ``setup``."""
    from fused_transformer.kernels.aot import kernel_modules

    kernel_modules()  # the kernel modules register their variants on import
    return list(op_cases(setup, quick))


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
