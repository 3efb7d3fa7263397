"""The attention kernels' tile plan (kernels/attention/configs.py): every launch finds its row, no row is dead, the
fallback order does what its docstring says, and the AOT report compiles exactly what the plan picks. No GPU and
no compilation: ``plan`` is pure Python, and the report's SASS figures are tests/test_report.py's."""
import itertools
import pathlib
import re

import pytest
import torch

from fused_transformer.kernels import toolchain
from fused_transformer.kernels.attention import TILE_ROWS, aot, configs, launch, plan
from fused_transformer.kernels.targets import BY_CAPABILITY, TARGETS, closest_target
from fused_transformer.tools import report

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}
HOPPER = BY_CAPABILITY[90]


def launches():
    """Every kind of launch a launcher can plan: (kernel, precision, head_dim, target, TMA-addressable inputs, scores_only,
    packed), at every head-dim bucket and at odd head dims inside them."""
    for kernel, precision in itertools.product(configs.KERNELS, configs.PRECISIONS):
        if kernel == "weights" and precision == "tf32":  # the weights kernel never runs in tf32
            continue
        for head_dim in (0, 1, 16, 24, 32, 40, 64, 72, 128, 200, 256):
            if head_dim > configs.MAX_HEAD_DIM[precision]:
                continue
            for target, addressable, scores_only, packed in itertools.product(TARGETS, (True, False), (False, True),
                                                                         (False, True)):
                if kernel == "weights" and packed:  # no packed variant
                    continue
                yield kernel, precision, head_dim, target, addressable, scores_only, packed


def plan_of(kernel, precision, head_dim, target, addressable=True, scores_only=False, packed=False, score_mods=False):
    return plan(kernel, DTYPES[precision], head_dim, target, allow_tf32=precision == "tf32",
                tma_addressable=addressable, scores_only=scores_only, packed=packed, score_mods=score_mods)


def row_of(kernel, precision, head_dim, target, addressable=True, scores_only=False, packed=False, triton=None,
           score_mods=False):
    tma = configs.takes_tma(kernel, precision, head_dim) and addressable and target.tma
    return configs.find_row(kernel, precision, head_dim, target.capability, tma, scores_only, packed,
                            triton or toolchain.installed(), score_mods)


def score_mods_launches():
    """The launches with softcap or ALiBi: never scores_only, never the weights kernel."""
    return (launch for launch in launches() if launch[0] != "weights" and not launch[5])


def test_every_launch_finds_a_row_and_every_row_is_picked():
    """Under every tested Triton release (kernels/toolchain.py), and some release picks each row."""
    picked = {row_of(*launch, triton=version) for launch in launches() for version in toolchain.TESTED}
    picked |= {row_of(*launch, triton=version, score_mods=True) for launch in score_mods_launches()
               for version in toolchain.TESTED}
    assert picked == set(TILE_ROWS), [row for row in TILE_ROWS if row not in picked]
    assert len(set(TILE_ROWS)) == len(TILE_ROWS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_the_argument_checks_refuse_every_head_dim_no_tile_serves(dtype):
    """The launchers' argument checks let through the head dims up to MAX_HEAD_DIM, which every launch above plans,
    and refuse the next one with a clear error, before any plan is asked: float32 stops at 128 with tf32 products
    too (the check cannot tell them apart, and tf32 launches fall back to float32's rows)."""
    precision = configs.precision_of(dtype)
    assert configs.MAX_HEAD_DIM["tf32"] == configs.MAX_HEAD_DIM["fp32"]
    limit = configs.MAX_HEAD_DIM[precision]
    widest, too_wide = (torch.empty(1, 1, 4, d, dtype=dtype, device="meta") for d in (limit, limit + 1))
    launch.check_inputs(widest, widest, widest)
    refusal = (f"float32 supports head_dim up to {limit}, got {limit + 1}" if dtype == torch.float32
               else rf"head_dim={limit + 1} is not supported \(0\.\.{limit}\)")
    with pytest.raises(ValueError, match=refusal):
        launch.check_inputs(too_wide, too_wide, too_wide)


def test_score_mods_rows_serve_score_mods_launches_only():
    """A launch without softcap or ALiBi never takes a score_mods row; one with them takes the general plan but where
    a score_mods row stands for its (kernel, precision, head dim, target, layout)."""
    for launch in launches():
        assert not row_of(*launch).score_mods, launch
    for launch in score_mods_launches():
        row, general = row_of(*launch, score_mods=True), row_of(*launch)
        assert row == general or row.score_mods, launch
        assert not row.scores_only
    assert row_of("bwd_dq", "fp32", 64, BY_CAPABILITY[80], score_mods=True).tile == configs.Tile(64, 16, 8, 1)


def test_a_head_dim_plans_as_its_bucket():
    for kernel, precision, head_dim, target, addressable, scores_only, packed in launches():
        bucket = configs.head_dim_bucket(head_dim)
        assert plan_of(kernel, precision, head_dim, target, addressable, scores_only, packed) == plan_of(
            kernel, precision, bucket, target, addressable, scores_only, packed)


def test_99_kb_parts_pick_tiles_that_fit_and_plan_alike():
    assert plan_of("fwd", "bf16", 64, BY_CAPABILITY[86]).tile.num_stages == 2  # 3 stages need 147 KB
    assert plan_of("fwd", "bf16", 64, BY_CAPABILITY[80]).tile.num_stages == 3
    for kernel, precision, head_dim, target, addressable, scores_only, packed in launches():
        if target.capability == 86:
            assert plan_of(kernel, precision, head_dim, target, addressable, scores_only, packed) == plan_of(
                kernel, precision, head_dim, BY_CAPABILITY[89], addressable, scores_only, packed)


def test_hopper_tiles_need_tma():
    """sm_90 takes rows of its own only through TMA: inputs TMA cannot address, and exact float32, plan as on
    sm_80 (the hopper rows spill 72-120 B on the pointer path), but where an older Triton's release row for one of
    the two decides (kernels/toolchain.py: its register allocation differs per target)."""
    for kernel, precision, head_dim, target, addressable, scores_only, packed in launches():
        if target is not HOPPER:
            continue
        hopper = plan_of(kernel, precision, head_dim, HOPPER, addressable, scores_only, packed)
        ampere = plan_of(kernel, precision, head_dim, BY_CAPABILITY[80], addressable, scores_only, packed)
        assert hopper.use_tma == (addressable and configs.takes_tma(kernel, precision, head_dim))
        rows = [row_of(kernel, precision, head_dim, t, addressable, scores_only, packed) for t in (HOPPER, BY_CAPABILITY[80])]
        if not hopper.use_tma and all(row.tritons.last is None for row in rows):
            assert hopper == ampere, (kernel, precision, head_dim, addressable, scores_only, packed)
    assert configs.TF32_TMA_HEAD_DIMS == (64, 128)
    assert [configs.takes_tma(kernel, "tf32", 64) for kernel in configs.KERNELS] == [True, False, False, False]
    assert not any(configs.takes_tma(kernel, "fp32", 64) for kernel in configs.KERNELS)


def test_light_rows_serve_light_launches_only():
    """Launches whose scores read an attn_mask tile or draw dropout never take a scores-only row; before sm_90 scores-only and
    other launches plan alike; packed scores-only launches never take a row that serves dense launches only."""
    for kernel, precision, head_dim, target, addressable, scores_only, packed in launches():
        row = row_of(kernel, precision, head_dim, target, addressable, scores_only, packed)
        assert scores_only or not row.scores_only
        assert ("packed" if packed else "dense") in row.layouts
        if target is not HOPPER:
            assert not row.scores_only
    # dq at D256: the scores-only tiles spill for packed sequences, which take the general ones
    assert row_of("bwd_dq", "bf16", 256, HOPPER, scores_only=True).layouts == ("dense",)
    assert row_of("bwd_dq", "bf16", 256, HOPPER, scores_only=True, packed=True).tile == row_of(
        "bwd_dq", "bf16", 256, HOPPER, packed=True).tile


def test_tf32_falls_back_to_float32_rows_where_it_has_none():
    for kernel, precision, head_dim, target, addressable, scores_only, packed in launches():
        if precision != "tf32":
            continue
        row = row_of(kernel, precision, head_dim, target, addressable, scores_only, packed)
        if row.precision == "fp32":
            assert not any(r.serves(kernel, "tf32", configs.head_dim_bucket(head_dim), target.capability,
                                    plan_of(kernel, "tf32", head_dim, target, addressable).use_tma, scores_only,
                                    "packed" if packed else "dense", toolchain.installed()) for r in TILE_ROWS)
        assert plan_of(kernel, precision, head_dim, target, addressable, scores_only, packed).dot_precision == "tf32"


def test_the_interpreter_plans_small_tiles_and_tma_only_when_asked(monkeypatch):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        interpreted = plan("fwd", dtype, 64, None, allow_tf32=True)
        assert interpreted.tile == configs.INTERPRETER_TILE and interpreted.interior_loop
        assert not interpreted.use_tma and interpreted.dot_precision == "ieee"
        assert interpreted.upcast == (dtype == torch.bfloat16)  # the interpreter's bfloat16 dots are wrong
    monkeypatch.setattr(configs, "TMA_UNDER_INTERPRETER", True)
    assert plan("bwd_dq", torch.bfloat16, 64, None).use_tma
    assert not plan("bwd_dq", torch.bfloat16, 64, None, tma_addressable=False).use_tma
    assert not plan("bwd_dq", torch.float32, 64, None).use_tma


def test_a_newer_gpu_plans_as_its_closest_target():
    blackwell, rtx_50 = closest_target(100, 232448), closest_target(120, 101376)
    for kernel, precision, head_dim, target, addressable, scores_only, packed in launches():
        if target.capability == 90:
            assert plan_of(kernel, precision, head_dim, blackwell, addressable, scores_only, packed) == plan_of(
                kernel, precision, head_dim, target, addressable, scores_only, packed)
        if target.capability == 89:
            assert plan_of(kernel, precision, head_dim, rtx_50, addressable, scores_only, packed) == plan_of(
                kernel, precision, head_dim, target, addressable, scores_only, packed)


def test_plan_constexprs_are_what_the_kernels_take():
    p = plan_of("bwd_dkdv", "bf16", 64, HOPPER, scores_only=True)
    assert p.constexprs() == dict(BLOCK_M=64, BLOCK_N=128, USE_TMA=True, DOT_PRECISION="ieee", UPCAST=False,
                                  INTERIOR_LOOP=True, DO_STRIDES=True)
    assert "INTERIOR_LOOP" not in plan_of("weights", "bf16", 64, HOPPER).constexprs()
    assert "DO_STRIDES" not in plan_of("fwd", "bf16", 64, HOPPER).constexprs()
    # A row whose tiles spill reading do through its strides says so, and its plan reads do in o's layout.
    assert not plan_of("bwd_dq", "tf32", 64, BY_CAPABILITY[80]).constexprs()["DO_STRIDES"]


# ----------------------------------------------------------------------------------- the report compiles the plan


def _variant(scores_only: bool, packed: bool, two_loop: bool) -> aot.FeatureSet:
    """The report's variant a launch of this kind is compiled in."""
    names = {(False, False, False): "", (False, True, False): "/varlen", (True, False, True): "/causal",
             (True, True, True): "/varlen/causal", (True, False, False): "/padded",
             (True, True, False): "/varlen/nodropout"}
    return next(v for v in aot.FEATURE_SETS if v.name == names[(scores_only, packed, two_loop)])


def test_the_report_compiles_every_plan_a_launcher_picks():
    """What plan() picks for each target is compiled by the report for that target, with the loads it picks there, in
    the variant that launch runs; /padded and /varlen/nodropout are listed only where their tiles are not the ones
    the dense or /varlen variant compiles with more features on."""
    listed = {(k.name, k.config, target): k for k in aot.aot_configs() for target in k.targets}
    checked = 0
    for kernel, precision, head_dim, target, addressable, scores_only, packed in launches():
        if not addressable or head_dim not in configs.HEAD_DIM_BUCKETS:
            continue
        for two_loop in (False, True) if scores_only and kernel != "weights" else (False,):
            variant = _variant(scores_only, packed, two_loop)
            chosen = plan_of(kernel, precision, head_dim, target, scores_only=scores_only, packed=packed)
            if variant.unless_tiles_of is not None and chosen.tile == plan_of(
                    kernel, precision, head_dim, target, packed=packed).tile:
                variant = next(v for v in aot.FEATURE_SETS if v.name == variant.unless_tiles_of)
            name = aot.config_name(precision, head_dim, chosen.tile, variant.name, chosen.use_tma)
            compiled = listed[(f"attention_{kernel}", name, target.capability)]
            assert compiled.constexprs.get("INTERIOR_LOOP", True) == chosen.interior_loop, name
            checked += 1
        if kernel != "weights" and not scores_only:  # the same launch with softcap / ALiBi
            chosen = plan_of(kernel, precision, head_dim, target, packed=packed, score_mods=True)
            name = aot.config_name(precision, head_dim, chosen.tile, "/varlen/scoremods" if packed else "/scoremods",
                                   chosen.use_tma)
            compiled = listed[(f"attention_{kernel}", name, target.capability)]
            assert all(compiled.constexprs["SCORE_MODS"]), name
            checked += 1
    assert checked > 1000


def test_the_report_compiles_the_two_loop_path_off_exactly_where_the_plan_turns_it_off():
    """Every (tile, loads, layout) a launch runs with its two-loop path off is compiled that way, and nothing else."""
    planned_off = set()
    for kernel, precision, head_dim, target, addressable, scores_only, packed in launches():
        chosen = plan_of(kernel, precision, head_dim, target, addressable, scores_only, packed)
        if kernel != "weights" and head_dim in configs.HEAD_DIM_BUCKETS and not chosen.interior_loop:
            planned_off.add((kernel, precision, head_dim, chosen.tile, chosen.use_tma, packed))
    compiled_off = {
        (k.name.removeprefix("attention_"), k.config.split("/")[0], k.constexprs["HEAD_DIM"],
         configs.Tile(k.constexprs["BLOCK_M"], k.constexprs["BLOCK_N"], k.num_warps, k.num_stages),
         k.constexprs["USE_TMA"], k.constexprs["VARLEN"])
        for k in aot.aot_configs() if k.constexprs.get("INTERIOR_LOOP") is False}
    assert planned_off and compiled_off == planned_off


@pytest.mark.parametrize("kernel", configs.KERNELS)
def test_every_row_is_compiled(kernel):
    """Each row is compiled by the report of some tested Triton release it holds for."""
    compiled = {(version, k.config.split("/")[0], int(k.config.split("/")[1][1:]), k.config.split("/")[2], target)
                for version in toolchain.TESTED for k in aot.aot_configs(triton=version)
                if k.name == f"attention_{kernel}" for target in k.targets}
    for row in (row for row in TILE_ROWS if row.kernel == kernel):
        assert any((version, row.precision, d, str(row.tile), t) in compiled for version in toolchain.TESTED
                   if version in row.tritons for d in row.head_dims for t in row.targets), row


def test_what_was_measured_about_the_rows_is_their_provenance_not_comments():
    """configs.py's comments hold no spill figure (what was measured lives in ``TileRow.provenance``, which the
    report's markdown shows), and every row for the older releases only says what spilled under them."""
    source = pathlib.Path(configs.__file__).read_text()
    figures = [line for line in source.splitlines() if re.search(r"#.*\b\d+(-\d+)? B\b", line)]
    assert not figures, figures
    older = [row for row in TILE_ROWS if row.tritons == toolchain.BEFORE_3_9]
    assert older and all(row.provenance for row in older), [row for row in older if not row.provenance]
    plan_lines = report.tile_plan_markdown()
    assert len(plan_lines) == 2 + len(TILE_ROWS)
    assert all(row.provenance in line for row, line in zip(TILE_ROWS, plan_lines[2:]) if row.provenance)
