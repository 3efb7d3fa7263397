"""The ``graphs`` part of ``python -m fused_transformer gpu-check``: three things only a GPU can show.

- CUDA graphs: a training step of ``fused_transformer.TransformerEncoderLayer`` (dropout 0, static input
  buffers) captured as one graph: forward, backward and an ``AdamW(capturable=True)`` step (forward and backward
  only, said so, when the optimizer step cannot be captured). Replayed on new data copied into the buffers, it
  must match the same step run eagerly on a twin from the same state: loss, output, every gradient and parameter,
  within ``GRAPH_TOLERANCE`` of the dtype (relative to each tensor's largest magnitude).
- Determinism: ``fused_transformer.attention`` forward + backward twice on identical inputs (bfloat16 and float16,
  causal and key-padded, ``DETERMINISM_SHAPES``) gives bitwise equal outputs and gradients (``torch.equal``).
- SDPA's determinism, for the route (``fused_transformer/route.py``, a row's ``torch_det``): each SDPA backend's
  forward + backward twice on identical inputs with no mask and causal (``SDPA_DETERMINISM_*``), as measured: with
  deterministic algorithms asked for, a call that needs gradients goes to SDPA only where its backward is
  deterministic, as ours is. Information, not a verdict.
- Memory: the peak memory of attention forward + backward above its inputs, at ``MEMORY_LENGTHS`` with batch,
  heads and head dim fixed, grows linearly: at most ``MAX_GROWTH_PER_DOUBLING`` times per doubling of L.

The rules (``differing``, ``relative_errors``, ``memory_growth``) are pure functions, tested on CPU tensors.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

GRAPH_LAYER = dict(d_model=512, nhead=8, dim_feedforward=2048)
GRAPH_BATCH, GRAPH_LENGTH, GRAPH_DTYPE, GRAPH_STEPS = 8, 256, torch.bfloat16, 2
GRAPH_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
GRAPH_LR = 1e-4
DETERMINISM_SHAPES = ((2, 8, 1000, 64), (1, 8, 2048, 128), (3, 4, 777, 64))  # (B, H, L, D)
DETERMINISM_MASKS = ("causal", "padded")
DETERMINISM_DTYPES = (torch.bfloat16, torch.float16)
# The route's calls (no mask or causal, head dims 64 and 128) at the bench's sizes; SDPBackend names.
SDPA_DETERMINISM_SHAPES = ((4, 16, 1024, 64), (1, 16, 4096, 128))
SDPA_DETERMINISM_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
MEMORY_LENGTHS = (1024, 2048, 4096, 8192)
MEMORY_SHAPE = dict(batch=2, heads=16, head_dim=64)
MAX_GROWTH_PER_DOUBLING = 2.2

Tensors = Dict[str, Tensor]


# ------------------------------------------------------------------------------------------------------ rules


def differing(first: Tensors, second: Tensors) -> List[str]:
    """The names whose tensors are not bitwise equal in the two runs (``torch.equal``), each with its largest
    difference; a name missing from either run counts as differing."""
    found = []
    for name in sorted(set(first) | set(second)):
        a, b = first.get(name), second.get(name)
        if a is None or b is None:
            found.append(f"{name} (missing in one run)")
        elif not torch.equal(a, b):
            gap = (a.double() - b.double()).abs().max().item() if a.shape == b.shape and a.numel() else math.nan
            found.append(f"{name} (max difference {gap:.3g})")
    return found


def relative_errors(got: Tensors, expected: Tensors) -> Dict[str, Tuple[float, float]]:
    """name -> (max |got - expected|, that over max |expected|) for every tensor of ``expected``; inf when a
    tensor is missing, of another shape or not finite."""
    errors = {}
    for name, want in expected.items():
        have = got.get(name)
        if have is None or have.shape != want.shape:
            errors[name] = (math.inf, math.inf)
            continue
        gap = (have.double() - want.double()).abs().max().item() if want.numel() else 0.0
        scale = want.double().abs().max().item() if want.numel() else 0.0
        gap = gap if math.isfinite(gap) else math.inf
        errors[name] = (gap, gap / scale if scale > 0 else (0.0 if gap == 0 else math.inf))
    return errors


def memory_growth(extra_bytes: Mapping[int, float], max_growth: float = MAX_GROWTH_PER_DOUBLING) -> dict:
    """Judge peak memory above the inputs, by sequence length: linear when from each length to the next it grows
    at most ``max_growth`` times per doubling of L (``(m2 / m1) ** (1 / log2(L2 / L1))``). ``linear`` is None when
    it cannot be judged (fewer than two lengths, or no extra memory at some length)."""
    lengths = sorted(extra_bytes)
    steps = []
    if len(lengths) < 2:
        return {"linear": None, "steps": steps, "verdict": "cannot judge: fewer than two lengths measured"}
    if any(extra_bytes[length] <= 0 for length in lengths):
        empty = ", ".join(str(length) for length in lengths if extra_bytes[length] <= 0)
        return {"linear": None, "steps": steps, "verdict": f"cannot judge: no extra memory measured at L = {empty}"}
    for short, long in zip(lengths, lengths[1:]):
        growth = (extra_bytes[long] / extra_bytes[short]) ** (1 / math.log2(long / short))
        steps.append({"from": short, "to": long, "growth_per_doubling": growth, "ok": growth <= max_growth})
    worst = max(steps, key=lambda step: step["growth_per_doubling"])
    linear = all(step["ok"] for step in steps)
    verdict = (f"{'linear' if linear else 'NOT linear'}: at most x{worst['growth_per_doubling']:.2f} per doubling of L "
               f"(L {worst['from']} -> {worst['to']}; limit x{max_growth:g})")
    return {"linear": linear, "steps": steps, "verdict": verdict}


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# ------------------------------------------------------------------------------------------------ CUDA graphs


def _training_step(layer: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], x: Tensor,
                   target: Tensor) -> Tuple[Tensor, Tensor]:
    out = layer(x)
    loss = F.mse_loss(out.float(), target.float())
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return out, loss


def _step_results(layer: torch.nn.Module, out: Tensor, loss: Tensor) -> Tensors:
    results = {"loss": loss.detach().clone(), "output": out.detach().clone()}
    for name, p in layer.named_parameters():
        results[f"d({name})"] = p.grad.detach().clone()
        results[name] = p.detach().clone()
    return results


def cuda_graph_step(device: torch.device, with_optimizer: bool = True) -> dict:
    """Capture a training step, replay it ``GRAPH_STEPS`` times on new data, compare with the eager twin."""
    import copy

    import fused_transformer as ft

    torch.manual_seed(0)
    build = dict(GRAPH_LAYER, dropout=0.0, batch_first=True, device=device, dtype=GRAPH_DTYPE)
    layer = ft.TransformerEncoderLayer(**build)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=GRAPH_LR, capturable=True) if with_optimizer else None
    shape = (GRAPH_BATCH, GRAPH_LENGTH, GRAPH_LAYER["d_model"])
    static_x, static_target = (torch.randn(shape, device=device, dtype=GRAPH_DTYPE) for _ in range(2))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside the capture: autotuning, allocations, the optimizer's state
        for _ in range(3):
            layer.zero_grad(set_to_none=True)
            _training_step(layer, optimizer, static_x, static_target)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)

    layer.zero_grad(set_to_none=True)
    twin = ft.TransformerEncoderLayer(**build)
    twin.load_state_dict(layer.state_dict())
    twin_optimizer = None
    if optimizer is not None:
        twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=GRAPH_LR, capturable=True)
        twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # its own copy of the moments

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_loss = _training_step(layer, optimizer, static_x, static_target)

    worst: Dict[str, Tuple[float, float]] = {}
    generator = torch.Generator(device=device).manual_seed(1)
    for _ in range(GRAPH_STEPS):
        x, target = (torch.randn(shape, device=device, dtype=GRAPH_DTYPE, generator=generator) for _ in range(2))
        static_x.copy_(x)
        static_target.copy_(target)
        graph.replay()
        replayed = _step_results(layer, static_out, static_loss)
        twin.zero_grad(set_to_none=True)
        eager = _step_results(twin, *_training_step(twin, twin_optimizer, x, target))
        for name, error in relative_errors(replayed, eager).items():
            worst[name] = max(worst.get(name, (0.0, 0.0)), error, key=lambda e: e[1])
    torch.cuda.synchronize(device)
    name, (abs_error, rel_error) = max(worst.items(), key=lambda item: item[1][1])
    tolerance = GRAPH_TOLERANCE[GRAPH_DTYPE]
    return {
        "ok": rel_error <= tolerance,
        "what": (f"TransformerEncoderLayer(d_model {GRAPH_LAYER['d_model']}, {GRAPH_LAYER['nhead']} heads, d_ff "
                 f"{GRAPH_LAYER['dim_feedforward']}, dropout 0), batch {GRAPH_BATCH}, L {GRAPH_LENGTH}, "
                 f"{str(GRAPH_DTYPE)[6:]}, {GRAPH_STEPS} replays on new data against eager steps"),
        "optimizer": "AdamW(capturable=True) step captured too" if with_optimizer else "not captured",
        "compared": len(worst), "worst": name, "max_abs_error": abs_error, "max_rel_error": rel_error,
        "tolerance": tolerance, "bitwise_equal": all(error[0] == 0 for error in worst.values()),
    }


def cuda_graph_check(device: torch.device) -> dict:
    """``cuda_graph_step`` with the optimizer step in the graph, else without it (saying why)."""
    try:
        return cuda_graph_step(device, with_optimizer=True)
    except Exception as exc:  # noqa: BLE001 (retried without the optimizer, then reported)
        with_optimizer = _describe(exc)
    try:
        result = cuda_graph_step(device, with_optimizer=False)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": f"{_describe(exc)} (with the optimizer step in the graph: {with_optimizer})"}
    result["optimizer"] = f"not captured ({with_optimizer}): forward + backward only"
    return result


# ------------------------------------------------------------------------------------------------ determinism


def _attention_run(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, kwargs: dict) -> Tensors:
    import fused_transformer as ft

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = ft.attention(*leaves, **kwargs)
    out.backward(grad)
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def determinism_check(device: torch.device) -> dict:
    cases = []
    for dtype in DETERMINISM_DTYPES:
        for batch, heads, length, head_dim in DETERMINISM_SHAPES:
            for mask in DETERMINISM_MASKS:
                case = {"dtype": str(dtype)[6:], "mask": mask, "shape": [batch, heads, length, head_dim]}
                try:
                    generator = torch.Generator(device=device).manual_seed(length + head_dim)
                    q, k, v, grad = (torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype,
                                                 generator=generator) for _ in range(4))
                    if mask == "causal":
                        kwargs: dict = {"is_causal": True}
                    else:
                        kept = torch.tensor([max(1, length - i * length // (batch + 1)) for i in range(batch)],
                                            device=device)
                        kwargs = {"key_padding_mask": torch.arange(length, device=device)[None, :] >= kept[:, None]}
                    _attention_run(q, k, v, grad, kwargs)  # compiles and autotunes outside the comparison
                    found = differing(_attention_run(q, k, v, grad, kwargs), _attention_run(q, k, v, grad, kwargs))
                    case.update(equal=not found, differing=found)
                except Exception as exc:  # noqa: BLE001 (this case fails; the others still run)
                    case.update(equal=False, error=_describe(exc))
                cases.append(case)
    return {"ok": all(case["equal"] for case in cases), "cases": cases}


def _sdpa_run(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, sdpa_backend: str, is_causal: bool) -> Tensors:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(getattr(SDPBackend, sdpa_backend)):
        out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal)
        out.backward(grad)
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def sdpa_determinism_check(device: torch.device, backends: Tuple[str, ...] = SDPA_DETERMINISM_BACKENDS,
                           shapes: Tuple[Tuple[int, int, int, int], ...] = SDPA_DETERMINISM_SHAPES) -> dict:
    """Whether each SDPA backend's backward gives bitwise equal gradients twice (``equal`` None where the backend
    cannot run the case: its error). Always ok: what SDPA does is measured here, not judged."""
    cases = []
    for sdpa_backend in backends:
        for dtype in DETERMINISM_DTYPES:
            for batch, heads, length, head_dim in shapes:
                for mask in ("none", "causal"):
                    case = {"backend": sdpa_backend.lower(), "dtype": str(dtype)[6:], "mask": mask,
                            "shape": [batch, heads, length, head_dim]}
                    try:
                        generator = torch.Generator(device=device).manual_seed(length + head_dim)
                        q, k, v, grad = (torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype,
                                                     generator=generator) for _ in range(4))
                        first = _sdpa_run(q, k, v, grad, sdpa_backend, mask == "causal")
                        found = differing(first, _sdpa_run(q, k, v, grad, sdpa_backend, mask == "causal"))
                        case.update(equal=not found, differing=found)
                    except Exception as exc:  # noqa: BLE001 (a backend that cannot run this case: said so)
                        case.update(equal=None, differing=[], error=_describe(exc))
                    cases.append(case)
    return {"ok": True, "what": "SDPA forward + backward twice on identical inputs, torch's default settings",
            "cases": cases}


# ----------------------------------------------------------------------------------------------------- memory


def memory_check(device: torch.device) -> dict:
    import fused_transformer as ft

    batch, heads, head_dim = MEMORY_SHAPE["batch"], MEMORY_SHAPE["heads"], MEMORY_SHAPE["head_dim"]
    rows = []
    for length in MEMORY_LENGTHS:
        q, k, v = (torch.randn(batch, heads, length, head_dim, device=device, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        for measured in (False, True):  # the first call compiles and autotunes, which allocates on its own
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            ft.attention(q, k, v).backward(grad)
            torch.cuda.synchronize(device)
            extra = torch.cuda.max_memory_allocated(device) - before
        inputs = sum(t.numel() * t.element_size() for t in (q, k, v, grad))
        rows.append({"seq_len": length, "inputs_mib": inputs / 2**20, "extra_mib": extra / 2**20})
        del q, k, v, grad
        torch.cuda.empty_cache()
    growth = memory_growth({row["seq_len"]: row["extra_mib"] for row in rows})
    for row in rows:
        row["growth_per_doubling"] = next((s["growth_per_doubling"] for s in growth["steps"]
                                           if s["to"] == row["seq_len"]), None)
    return {"ok": growth["linear"] is True, "what": f"attention fwd+bwd, bfloat16, batch {batch}, {heads} heads, "
            f"head dim {head_dim}, no mask", "rows": rows, "linear": growth["linear"], "verdict": growth["verdict"]}


# -------------------------------------------------------------------------------------------------------- all


CHECKS: Tuple[Tuple[str, Callable[[torch.device], dict]], ...] = (
    ("cuda_graph", cuda_graph_check), ("determinism", determinism_check),
    ("sdpa_determinism", sdpa_determinism_check), ("memory", memory_check))


def problems_of(figures: Mapping[str, dict]) -> List[str]:
    """One line per check that did not pass, for the part's reason."""
    problems = []
    for name, result in figures.items():
        if result.get("ok"):
            continue
        if result.get("error"):
            problems.append(f"{name}: {result['error']}")
        elif name == "cuda_graph":
            problems.append(f"CUDA graph replay differs from eager: {result['worst']} max relative error "
                            f"{result['max_rel_error']:.3g} > {result['tolerance']:g}")
        elif name == "determinism":
            bad = [case for case in result["cases"] if not case["equal"]]
            problems.append(f"backward not deterministic in {len(bad)} of {len(result['cases'])} cases")
        elif name == "memory":
            problems.append(f"peak memory {result['verdict']}")
    return problems


def run_all(save: Callable[[dict], None]) -> Tuple[dict, List[str]]:
    """Every check on the current CUDA device, ``save(figures so far)`` after each; (figures, problems)."""
    from fused_transformer import backend

    device = torch.device("cuda", torch.cuda.current_device())
    reason = backend.triton_unavailable_reason()
    if reason is not None:
        return {}, [f"the Triton kernels cannot run: {reason}"]
    figures: dict = {}
    for name, check in CHECKS:
        print(f"graphs: {name} ...", flush=True)
        try:
            figures[name] = check(device)
        except Exception as exc:  # noqa: BLE001 (a CUDA fault here is reported; the next check may still run)
            figures[name] = {"ok": False, "error": _describe(exc)}
        print(f"graphs: {name}: {'ok' if figures[name]['ok'] else 'NOT OK'}", flush=True)
        save(figures)
    return figures, problems_of(figures)
