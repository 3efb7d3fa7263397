"""What the AOT report compiles of the attention kernels: every tile ``configs.plan`` picks for each target, in
each feature set a launch runs with (``FEATURE_SETS``), with the loads the plan picks there, in the default variant
and in each of the plan's other variants (``configs.VARIANTS``) where it changes the launch."""
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from ..aot import AotKernel
from ..targets import TARGETS
from ..toolchain import Version
from . import configs
from .bwd import attention_dkdv_kernel, attention_dq_kernel
from .decode import aot_configs as decode_aot_configs
from .fwd import attention_fwd_kernel
from .jit import EVERY_SCORE_MOD, MODS_SIGNATURE, NO_SCORE_MOD
from .lengths import aot_configs as lengths_aot_configs
from .launch import MASK_FLOAT, MASK_NONE
from .weights import attention_weights_kernel

KERNELS = {"fwd": attention_fwd_kernel, "bwd_dq": attention_dq_kernel, "bwd_dkdv": attention_dkdv_kernel,
           "weights": attention_weights_kernel}
TRAINING_KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")


class FeatureSet(NamedTuple):
    """A feature set the report compiles a tile config in (its config-name suffix is ``name``)."""

    name: str
    features: Dict[str, object]  # the kernels' mask constexprs, and HAS_DROPOUT when it is off
    kernels: Tuple[str, ...]  # the kernels that have it
    # Compiled only for the targets where it picks other tiles than this variant does (elsewhere it runs that
    # feature set's tiles with fewer features); None: everywhere.
    unless_tiles_of: object = None
    float_output: bool = False  # the forward writes o in float32 (kept for the sinks' gradient)

    @property
    def packed(self) -> bool:
        return bool(self.features["VARLEN"])

    @property
    def score_mods(self) -> bool:
        return any(self.features.get("SCORE_MODS", NO_SCORE_MOD))

    @property
    def scores_only(self) -> bool:
        return (self.features["MASK_KIND"] == MASK_NONE and not self.features.get("HAS_DROPOUT", True)
                and not self.score_mods)


def _features(mask_kind: int, padding: bool, query_padding: bool, window: bool, varlen: bool, **extra) -> dict:
    return dict(MASK_KIND=mask_kind, HAS_PADDING=padding, HAS_QUERY_LENS=padding, HAS_QUERY_PADDING=query_padding,
                IS_CAUSAL=True, HAS_WINDOW=window, PER_SEQUENCE_OFFSET=True, VARLEN=varlen, **extra)


SCORE_MODS = dict(SCORE_MODS=EVERY_SCORE_MOD, HAS_SINKS=True)
# Dense with every mask on (the largest register footprint), and packed sequences, which take no attn_mask or
# padding but compute their bounds and alignment per sequence; the two-loop path (unmasked interior tiles), causal
# with the most it takes and no dropout; and the most a scores-only launch takes, dense and packed.
FEATURE_SETS = (
    FeatureSet("", _features(MASK_FLOAT, True, True, True, False), tuple(KERNELS)),
    FeatureSet("/varlen", _features(MASK_NONE, False, False, True, True), TRAINING_KERNELS),
    FeatureSet("/causal", _features(MASK_NONE, True, False, False, False, HAS_DROPOUT=False), TRAINING_KERNELS),
    FeatureSet("/varlen/causal", _features(MASK_NONE, False, False, False, True, HAS_DROPOUT=False), TRAINING_KERNELS),
    FeatureSet("/padded", _features(MASK_NONE, True, True, True, False, HAS_DROPOUT=False), TRAINING_KERNELS, ""),
    FeatureSet("/varlen/nodropout", _features(MASK_NONE, False, False, True, True, HAS_DROPOUT=False), TRAINING_KERNELS,
            "/varlen"),
    # every score modifier and sinks (which take the tiles of the launches above that are not scores-only), dense with
    # padding and a window, and packed; and the forward of trainable sinks in 16 bits, which writes o in float32.
    FeatureSet("/scoremods", _features(MASK_NONE, True, True, True, False, **SCORE_MODS), TRAINING_KERNELS),
    FeatureSet("/varlen/scoremods", _features(MASK_NONE, False, False, True, True, **SCORE_MODS), TRAINING_KERNELS),
    FeatureSet("/scoremods/float_o", _features(MASK_NONE, True, True, True, False, **SCORE_MODS), ("fwd",),
            float_output=True),
    FeatureSet("/varlen/scoremods/float_o", _features(MASK_NONE, False, False, True, True, **SCORE_MODS), ("fwd",),
            float_output=True),
)
# Pointers whose type does not follow the inputs' dtype (the float mask as a float32 additive bias).
POINTER_TYPES = {"LSE": "*fp32", "DLSE": "*fp32", "DELTA": "*fp32", "MASK": "*fp32", "PAD": "*u8", "KEY_LENS": "*i32",
                 "QUERY_LENS": "*i32", "QUERY_PAD": "*u8", "CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32",
                 "SEED": "*i64", "SINKS": "*fp32", "MODS": MODS_SIGNATURE}
# The inputs each kernel loads through TMA, in BLOCK_M-row (query) or BLOCK_N-row (key) tiles (and dk / dv, which
# dense launches store through TMA).
TMA_INPUTS = {"fwd": ("Q", "K", "V"), "bwd_dq": ("Q", "K", "V", "O", "DO"),
              "bwd_dkdv": ("Q", "K", "V", "DO", "DK", "DV"), "weights": ("Q", "K")}
QUERY_TILE_INPUTS = ("Q", "O", "DO")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}


def config_name(precision: str, head_dim: int, tile: configs.Tile, variant: str, use_tma: bool,
                plan_variant: str = configs.DEFAULT_VARIANT) -> str:
    """The report's name of a config: ``bf16/D64/BM128_BN64_w8_s3/causal/tma``, with the plan's variant after a
    ``+`` where it is not the default: ``bf16/D64/BM128_BN64_w8_s3/causal/tma+persistent``."""
    suffix = "" if plan_variant == configs.DEFAULT_VARIANT else f"+{plan_variant}"
    return f"{precision}/D{head_dim}/{tile}{variant}{'/tma' if use_tma else ''}{suffix}"


def _plans(kernel: str, precision: str, head_dim: int, variant: FeatureSet, triton: Optional[Version],
           plan_variant: str = configs.DEFAULT_VARIANT) -> Dict[configs.Plan, List[int]]:
    """(plan, targets picking it) for a launch of ``variant``'s features, as each target's launcher plans it under
    Triton release ``triton`` in the plan's ``plan_variant`` (only the targets where that changes the launch, for
    another variant than the default)."""
    picked: Dict[configs.Plan, List[int]] = {}
    for target in TARGETS:
        def plan(scores_only: bool) -> configs.Plan:
            return configs.plan(kernel, DTYPES[precision], head_dim, target, allow_tf32=precision == "tf32",
                                scores_only=scores_only, packed=variant.packed, triton=triton,
                                score_mods=variant.score_mods, variant=plan_variant, refused_too=True)

        chosen = plan(variant.scores_only)
        if chosen.variant != plan_variant:  # the variant changes nothing here: the default's compilation holds
            continue
        if variant.unless_tiles_of is not None and chosen.tile == plan(False).tile:
            continue
        picked.setdefault(chosen, []).append(target.capability)
    return picked


def aot_configs(triton: Optional[Version] = None) -> List[AotKernel]:
    """Every attention kernel x tile config the launchers pick on a GPU with Triton release ``triton`` (default: the
    installed one), in bfloat16 (16-bit tiles), float32 and float32 with tf32 products, for the targets that pick it,
    in each feature set of ``FEATURE_SETS``, in the default variant and the others the plan builds."""
    shipped = []
    for kernel in configs.KERNELS:
        for bits_precision in ("bf16", "fp32"):
            # float32 with allow_tf32=True too (never taken by the weights kernel).
            precisions = ("fp32", "tf32") if bits_precision == "fp32" and kernel != "weights" else (bits_precision,)
            for head_dim in configs.HEAD_DIM_BUCKETS:
                if head_dim > configs.MAX_HEAD_DIM[bits_precision]:
                    continue
                for precision in precisions:
                    for variant in FEATURE_SETS:
                        # float32 inputs write a float32 o anyway
                        if kernel not in variant.kernels or (variant.float_output and precision != "bf16"):
                            continue
                        for plan_variant in configs.VARIANTS:
                            if plan_variant.builds_on or kernel not in plan_variant.kernels:
                                continue
                            for plan, targets in _plans(kernel, precision, head_dim, variant, triton,
                                                        plan_variant.name).items():
                                shipped.append(_aot_kernel(kernel, precision, head_dim, variant, plan, tuple(targets)))
    shipped.extend(decode_aot_configs(triton))
    shipped.extend(lengths_aot_configs(triton))
    return shipped


def _aot_kernel(kernel: str, precision: str, head_dim: int, variant: FeatureSet, plan: configs.Plan,
                targets: Tuple[int, ...]) -> AotKernel:
    fn, tile = KERNELS[kernel], plan.tile
    elem = "*bf16" if precision == "bf16" else "*fp32"
    signature = {}
    for name in fn.arg_names:
        if plan.use_tma and name in TMA_INPUTS[kernel] and not (variant.packed and name in ("DK", "DV")):
            rows = tile.block_m if name in QUERY_TILE_INPUTS else tile.block_n
            signature[name] = f"tensordesc<{elem[1:]}[1,1,{rows},{head_dim}]>"
        elif name in POINTER_TYPES:
            signature[name] = POINTER_TYPES[name]
        elif name == "O" and variant.float_output:
            signature[name] = "*fp32"
        elif name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "W"):
            signature[name] = elem
        elif name in ("qk_scale", "dropout_p"):
            signature[name] = "fp32"
        elif name.islower():
            signature[name] = "i32"
    constexprs = dict(BLOCK_D=head_dim, HEAD_DIM=head_dim, MASK_OFFSETS_64=False, HAS_DROPOUT=True, HAS_DLSE=True,
                      SCORE_MODS=NO_SCORE_MOD, HAS_SINKS=False, **plan.constexprs())
    constexprs.update(variant.features)
    return AotKernel(
        name=f"attention_{kernel}", config=config_name(precision, head_dim, tile, variant.name, plan.use_tma,
                                                       plan.variant), fn=fn,
        signature=signature, constexprs={name: value for name, value in constexprs.items() if name in fn.arg_names},
        num_warps=tile.num_warps, num_stages=tile.num_stages, expect_tensor_cores=precision == "bf16",
        expect_instructions=configs.VARIANTS_BY_NAME[plan.variant].claims,
        refused=configs.VARIANTS_BY_NAME[plan.variant].refused,
        targets=targets,
        # What the JIT specialises for inputs from torch: aligned pointers and strides, odd lengths.
        divisible_by_16=tuple(n for n, t in signature.items() if isinstance(t, tuple) or t.startswith("*")
                              or n.startswith("stride_")),
    )
