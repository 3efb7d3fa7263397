"""AOT compile of a sample of the shipped kernel configs for sm_80 / 86 / 89 / 90 (no GPU needed): no spills, shared
memory within the limits, tensor cores where expected, the SASS figures (MMA shapes, main loop, occupancy) on the real
kernels and on hand-written SASS; and the AOT lists cover every config the launchers can pick.

The sample (``SAMPLE``) holds every kernel on each of its targets in each precision and every config the SASS tests
read; the whole list, every config for every target, is the report's own run, a step of CI of its own (.ci/run,
.ci/versions) that fails on a spill or a compiler error. Compilation runs in spawned workers (this process interprets
Triton); Triton's on-disk cache makes reruns fast.
"""
import dataclasses
import importlib
import re

import pytest
import torch

from fused_transformer.tools import report, sass
from fused_transformer.kernels import feed_forward, layer_norm, toolchain
from fused_transformer.kernels.attention import TILE_ROWS, configs, plan
from fused_transformer.kernels.targets import BY_CAPABILITY, TARGETS


PRECISIONS = ("bf16", "fp16", "tf32", "fp32")
# What the SASS tests below read, compiled in full but for the score-modifier variants: (kernel names, precision,
# target).
READ_IN_FULL = (
    (("attention_fwd", "attention_bwd_dq", "attention_bwd_dkdv", "attention_weights"), "bf16", 90),
    (("attention_fwd",), "tf32", 90),
)


def _kind(kernel: report.AotKernel, target: int) -> tuple:
    """``(kernel name, precision or "", target)``: what the sample holds at least one config of."""
    head = kernel.config.split("/")[0]
    return kernel.name, head if head in PRECISIONS else "", target


def _sampled(kernel: report.AotKernel, target: int, seen: set) -> bool:
    kind = _kind(kernel, target)
    first = kind not in seen
    seen.add(kind)
    read = "/scoremods" not in kernel.config and any(kernel.name in names and kind[1:] == (p, t)
                                                     for names, p, t in READ_IN_FULL)
    return (first or read
            or kind == ("attention_fwd", "bf16", 80) and kernel.config.endswith("/causal")
            or kernel.name == "layer_norm_bwd" and ("BLOCK_N=16384" in kernel.config or "SPLIT_COLS" in kernel.config))


def sample_work():
    """``SAMPLE``: ``report.jobs_for`` entries of the first config of every kernel in each precision on each of its
    targets, the configs ``READ_IN_FULL`` names, the general causal forward on sm_80 and the widest LayerNorm backward
    rows."""
    seen = set()
    return [(module, index, target) for module, index, target in report.jobs_for(report.KERNEL_MODULES)
            if _sampled(report._configs(module)[index], target, seen)]


SAMPLE = sample_work()


@pytest.fixture(scope="module")
def results():
    return report.compile_all(jobs=2, work=SAMPLE)


def test_the_sample_holds_every_kernel_precision_and_target_and_a_quarter_of_the_configs_at_most():
    every = report.jobs_for(report.KERNEL_MODULES)

    def kinds(work):
        return {(module, *_kind(report._configs(module)[index], target)) for module, index, target in work}

    assert kinds(SAMPLE) == kinds(every) and set(SAMPLE) <= set(every)
    assert len(SAMPLE) <= len(every) / 4


@pytest.mark.slow
def test_every_sampled_config_compiles_within_limits(results):
    assert len(results) == len(SAMPLE)
    failed = [r for r in results if not r.ok]
    assert not failed, "\n" + report.format_table(failed)


@pytest.mark.slow
def test_matmuls_use_tensor_cores(results):
    matmuls = [r for r in results if r.expect_tensor_cores]
    assert matmuls, "no kernel expects tensor cores: the fp16/bf16 matmul configs are missing"
    assert all(r.tensor_cores for r in matmuls)


@pytest.mark.slow
def test_every_target_users_have_is_compiled(results):
    assert {r.target for r in results} == {80, 86, 89, 90}
    by_kernel = {}
    for r in results:
        by_kernel.setdefault(r.name, set()).add(r.target)
    assert all(targets == {80, 86, 89, 90} for targets in by_kernel.values()), by_kernel


@pytest.mark.parametrize("module", report.KERNEL_MODULES)
def test_every_module_lists_configs(module):
    configs = importlib.import_module(module).aot_configs()
    assert configs and all(isinstance(k, report.AotKernel) for k in configs)
    assert all(set(k.targets) <= set(report.SHARED_MEMORY_LIMIT) for k in configs)


def _hidden_sizes():
    sizes = {1, 13, 1000, layer_norm.MAX_HIDDEN}
    for i in range(15):
        sizes |= {2**i - 1, 2**i, 2**i + 1}
    return sorted(n for n in sizes if 1 <= n <= layer_norm.MAX_HIDDEN)


def test_layer_norm_configs_cover_every_block_the_launcher_picks():
    configs = layer_norm.aot_configs()
    fwd = {(k.constexprs["BLOCK_N"], k.num_warps) for k in configs if k.name == "layer_norm_fwd"}
    bwd = {(k.constexprs["BLOCK_N"], k.constexprs["SPLIT_COLS"], k.num_warps, k.num_ctas, target) for k in configs
           if k.name == "layer_norm_bwd" for target in k.targets}
    for n in _hidden_sizes():
        block_n = layer_norm.block_width(n)
        assert (block_n, layer_norm.warps_for(block_n)) in fwd, n
        for target in report.TARGETS:
            launch = layer_norm.bwd_launch(n, clusters=target >= 90)
            picked = (launch.block_n, launch.col_blocks > 1, launch.num_warps, launch.num_ctas, target)
            assert picked in bwd, (n, target)
    assert any(k.name == "sum_rows" for k in configs)


@pytest.mark.slow
def test_layer_norm_backward_holds_the_widest_rows_on_a_cluster_on_hopper_only(results):
    """Rows above 8192 columns: one program of two CTAs (a cluster) per row on sm_90, 16 warps and 128 registers a
    thread each, the row sums reduced across the pair; before sm_90 the split kernel."""
    rows = {r.target: r for r in results if r.name == "layer_norm_bwd" and "BLOCK_N=16384" in r.config}
    assert set(rows) == {90} and rows[90].config == "BLOCK_N=16384,CTAS=2" and rows[90].ok
    assert rows[90].num_warps == 16 and rows[90].registers <= 128 and rows[90].blocks_per_sm == 1
    split = {r.target: r for r in results if r.name == "layer_norm_bwd" and r.config == "BLOCK_N=8192,SPLIT_COLS"}
    assert set(split) == {80, 86, 89} and all(r.ok and r.num_warps == 16 for r in split.values())


def test_layer_norm_configs_do_not_depend_on_the_interpreter():
    # This process interprets Triton (one warp per launch); the AOT list must hold the GPU's warps.
    warps = {k.constexprs["BLOCK_N"]: k.num_warps for k in layer_norm.aot_configs() if k.name == "layer_norm_fwd"}
    assert warps[16384] == layer_norm.warps_for(16384) > 1


def test_feed_forward_configs_are_the_launched_activation_pass_in_every_dtype():
    configs = {(k.name, k.config): k for k in feed_forward.aot_configs()}
    for ty in ("fp16", "bf16", "fp32"):
        for name in ("ffn_activation_fwd", "ffn_activation_bwd"):
            k = configs[(name, f"{ty}/BLOCK={feed_forward.BLOCK}")]
            assert (k.num_warps, k.constexprs["BLOCK"]) == (feed_forward.NUM_WARPS, feed_forward.BLOCK)
            assert k.constexprs["ACTIVATION_GRAD"] == name.endswith("bwd") and k.constexprs["HAS_DROPOUT"]
            assert not k.expect_tensor_cores and k.targets == tuple(t.capability for t in TARGETS)


def test_problems_are_reported():
    base = dict(module="m", name="k", config="c", num_warps=4)
    assert report.AotResult(**base, target=80, registers=64).ok
    assert not report.AotResult(**base, target=80, stack_bytes=8).ok
    assert not report.AotResult(**base, target=80, shared_bytes=report.SHARED_MEMORY_LIMIT[80] + 1).ok
    assert report.AotResult(**base, target=90, shared_bytes=report.SHARED_MEMORY_LIMIT[80] + 1).ok
    assert not report.AotResult(**base, target=90, expect_tensor_cores=True).ok
    assert not report.AotResult(**base, target=90, error="boom").ok
    table = report.format_table([report.AotResult(**base, target=90, spill_bytes=4)])
    assert "FAIL" in table and "sm_90" in table


@pytest.mark.slow
def test_report_command_prints_every_kernel_and_config(results, monkeypatch, capsys):
    from fused_transformer.__main__ import main

    monkeypatch.setattr(report, "compile_all", lambda jobs, modules, figures, work: [r for r in results if r.module in modules])
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    for module in report.KERNEL_MODULES:
        for kernel in importlib.import_module(module).aot_configs():
            assert kernel.name in out
    for r in results:
        assert r.config in out
    assert "sm_80" in out and "sm_90" in out
    assert f"{len(results)} compilations, 0 failed" in out


@pytest.mark.slow
def test_report_command_exits_1_when_a_compilation_fails(results, monkeypatch, capsys):
    from dataclasses import replace

    from fused_transformer.__main__ import main

    broken = [replace(results[0], spill_bytes=8)] + list(results[1:])
    monkeypatch.setattr(report, "compile_all", lambda jobs, modules, figures, work: broken)
    assert main(["report"]) == 1
    assert "1 failed" in capsys.readouterr().out


@pytest.mark.slow
def test_report_writes_its_markdown_with_where_it_comes_from(results, monkeypatch, tmp_path, capsys):
    from fused_transformer.__main__ import main
    from fused_transformer.tools import provenance

    monkeypatch.setattr(report, "compile_all", lambda jobs, modules, figures, work: results)
    path = tmp_path / "report.md"
    assert main(["report", "--markdown", str(path)]) == 0
    text = path.read_text()
    assert text.startswith("# AOT resource report\n") and f"report --markdown {path}" in text
    header = provenance.parse_header(text.splitlines()[2])
    assert header["command"] == f"report --markdown {path}" and header["triton"] == provenance.package_version("triton")
    assert header["commit"] == provenance.commit() != "unknown"
    assert bool(header["uncommitted"]) == provenance.sources_changed()
    assert f"{len(results)} compilations, 0 failed" in text
    assert "| attention_fwd | bf16/D64/" in text and "| layer_norm_bwd | BLOCK_N=16384,CTAS=2 | sm_90 |" in text
    with pytest.raises(SystemExit) as exc:  # the markdown covers every module
        main(["report", "--markdown", str(path), "--module", report.KERNEL_MODULES[0]])
    assert exc.value.code == 2 and "--markdown writes the report of every module" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # and its figures
        main(["report", "--markdown", str(path), "--verdicts-only"])
    assert exc.value.code == 2 and "--markdown writes the report of every module" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # and every config
        main(["report", "--markdown", str(path), "--sample"])
    assert exc.value.code == 2 and "--markdown writes the report of every module" in capsys.readouterr().err


def test_the_release_sample_compiles_every_tile_of_every_target_once_in_its_heaviest_variant(monkeypatch, capsys):
    every = report.jobs_for(report.KERNEL_MODULES)
    sample = report.release_sample(every)
    compiled = []
    monkeypatch.setattr(report, "compile_all", lambda jobs, modules, figures, work: compiled.extend(work) or [])
    assert report.main(["--verdicts-only", "--sample"]) == 0 and compiled == sample
    assert f"0 compilations (the release sample of {len(every)}), 0 failed" in capsys.readouterr().out

    def tile(job):
        module, index, target = job
        kernel = report._configs(module)[index]
        return module, kernel.name, report.tile_of(kernel.config), target

    assert len({tile(job) for job in sample}) == len(sample) and {tile(job) for job in every} == set(map(tile, sample))
    heaviest = {}
    for job in every:
        weight = report.variant_weight(report._configs(job[0])[job[1]].config)
        heaviest[tile(job)] = max(heaviest.get(tile(job), 0), weight)
    assert all(report.variant_weight(report._configs(job[0])[job[1]].config) == heaviest[tile(job)] for job in sample)
    assert len(sample) < 0.6 * len(every)  # what makes it worth running: the attention variants share their tiles
    assert report.tile_of("bf16/D64/BM128_BN64_w8_s3/varlen/scoremods/tma") == "bf16/D64/BM128_BN64_w8_s3/tma"
    assert report.variant_weight("bf16/D64/BM128_BN64_w8_s3/varlen/scoremods/tma") > report.variant_weight(
        "bf16/D64/BM128_BN64_w8_s3/causal/tma")


@pytest.mark.slow
def test_verdicts_only_gives_the_same_verdicts_and_reads_sass_only_for_wgmma(results):
    """Without figures (CI's older releases), a config compiles as with them: the same registers, spills, shared
    memory and tensor cores; only sm_90's wgmma matmuls are disassembled, for their serialization verdict."""
    module = "fused_transformer.kernels.attention"
    kernels = importlib.import_module(module).aot_configs()
    picked = [next((module, i, t) for i, k in enumerate(kernels) for t in k.targets
                   if t == target and k.expect_tensor_cores) for target in (80, 90)]
    for (_, index, target), verdict in zip(picked, report.compile_all(jobs=2, figures=False, work=picked)):
        [full] = [r for r in results if (r.module, r.name, r.config, r.target) == (module, kernels[index].name,
                                                                                  kernels[index].config, target)]
        same = ("registers", "spill_bytes", "stack_bytes", "shared_bytes", "tensor_cores", "blocks_per_sm", "error")
        assert {f: getattr(verdict, f) for f in same} == {f: getattr(full, f) for f in same}, target
        assert verdict.ok and full.mma_counts
        assert bool(verdict.mma_counts) == (target == 90) == report.needs_sass(kernels[index], target, False)
        if target == 90:
            assert (verdict.mma_counts, verdict.serialized_mmas) == (full.mma_counts, full.serialized_mmas)


@pytest.mark.slow
def test_sm_80_and_sm_89_from_sm_86_compilation_give_what_compiling_them_gives():
    """The report compiles a config listed for sm_86 once, goes on from its TTGIR for sm_80 and has ptxas assemble
    its PTX for sm_89 (``STARTS_FROM``); compiled for them from the source instead, the first such config of every
    kernel gives the same result: registers, spills, shared memory, occupancy and every SASS figure. CI's older
    Triton releases run this test too (.ci/versions)."""
    picked = []
    for module in report.KERNEL_MODULES:
        names = set()
        for index, kernel in enumerate(importlib.import_module(module).aot_configs()):
            shared = [target for target in (80, 86, 89) if target in kernel.targets]
            if 86 in shared and len(shared) > 1 and kernel.name not in names:
                names.add(kernel.name)
                picked += [(module, index, target) for target in shared]
    assert {target for _, _, target in picked} == {80, 86, 89} and len(picked) >= 2 * 10
    started = report.compile_all(jobs=2, figures=True, work=picked)
    compiled = report.compile_all(jobs=2, figures=True, share_stages=False, work=picked)
    assert [(r.module, r.name, r.target) for r in started] == [
        (module, importlib.import_module(module).aot_configs()[index].name, target) for module, index, target in picked]
    assert all(r.ok and r.registers for r in started)
    assert started == compiled


def test_the_report_starts_sm_80_and_sm_89_from_sm_86_only_where_one_config_lists_them():
    work = [("m", 0, 80), ("m", 0, 86), ("m", 0, 89), ("m", 0, 90), ("m", 1, 89), ("n", 0, 86), ("m", 2, 86),
            ("m", 2, 80), ("m", 3, 80)]
    assert report._units(work, share_stages=True) == [
        ("m", 0, (86, 80, 89)), ("m", 0, (90,)), ("m", 1, (89,)), ("n", 0, (86,)), ("m", 2, (86, 80)), ("m", 3, (80,))]
    assert report._units(work, share_stages=False) == [(module, index, (target,)) for module, index, target in work]
    ptx = "//\n.version 8.7\n.target sm_86\n.address_size 64\n\t// .globl k\n.target sm_86x\n"
    assert report.retarget(ptx, "ptx", 86, 89) == ptx.replace(".target sm_86\n", ".target sm_89\n")
    with pytest.raises(RuntimeError, match="expected sm_80 named once in the ptx, found 0 times"):
        report.retarget(ptx, "ptx", 80, 89)
    ttgir = 'module attributes {"ttg.num-warps" = 4 : i32, ttg.target = "cuda:86", "ttg.threads-per-warp" = 32} {}'
    assert report.retarget(ttgir, "ttgir", 86, 80) == ttgir.replace("cuda:86", "cuda:80")
    quoted = ttgir.replace("ttg.target", '"ttg.target"')
    assert report.retarget(quoted, "ttgir", 86, 80) == quoted.replace("cuda:86", "cuda:80")
    with pytest.raises(RuntimeError, match="found 2 times"):
        report.retarget(ttgir + ttgir, "ttgir", 86, 80)


# ------------------------------------------------------------------------------------ SASS figures, real kernels


def _attention_16_bit(results):
    return [r for r in results if r.name in ("attention_fwd", "attention_bwd_dq", "attention_bwd_dkdv")
            and r.config.startswith("bf16/")]


@pytest.mark.slow
def test_16_bit_attention_runs_hgmma_on_hopper_and_hmma_before(results):
    """wgmma (HGMMA) computes 64-row products per warpgroup: a config whose tiles are all under 64 rows (the shared
    D256 tiles) runs mma.sync (HMMA) on sm_90 too."""
    checked = _attention_16_bit(results)
    assert {r.target for r in checked} == {80, 86, 89, 90}
    assert any(r.target == 90 and r.mma_counts[0][0].startswith("HGMMA.") for r in checked)
    for r in checked:
        block_m, block_n = map(int, re.search(r"BM(\d+)_BN(\d+)", r.config).groups())
        wgmma = r.target == 90 and max(block_m, block_n) >= 64
        kinds = {opcode.split(".")[0] for opcode, _ in r.mma_counts}
        assert kinds == ({"HGMMA"} if wgmma else {"HMMA"}), (r.name, r.config, r.target, r.mma_counts)
        if not wgmma:
            assert all(opcode.startswith("HMMA.16816.F32.BF16") for opcode, _ in r.mma_counts), r.mma_counts


def _hopper_rows(scores_only: bool, layout: str = "dense"):
    """The plan's sm_90 rows (through TMA) for scores-only launches or any launch without score modifiers, serving
    ``layout``, under the installed Triton (the report compiles its plans): ``(kernel, head_dim, tile)``."""
    return [(row.kernel, head_dim, row.tile) for row in TILE_ROWS if row.targets == (90,) and row.loads == "tma"
            and row.precision == "bf16" and row.scores_only == scores_only and layout in row.layouts and not row.score_mods
            and toolchain.installed() in row.tritons for head_dim in row.head_dims]


def _hgmma_widths(r):
    shapes = [re.match(r"HGMMA\.64x(\d+)x16\.", opcode) for opcode, _ in r.mma_counts]
    assert all(shapes), (r.config, r.mma_counts)
    return [int(m.group(1)) for m in shapes]


# Launches whose any-launch sm_90 tile is narrower, with the tile that spilled: packed dq at head dim 128 takes 32
# keys a tile (BM128_BN64_w8_s3 and BM64_BN64_w4_s2 put 8 B on the stack with seven-round dropout under 3.9).
NARROW_HOPPER_LAUNCHES = {("bwd_dq", 128, "packed"): 32}


@pytest.mark.slow
def test_16_bit_attention_on_hopper_is_pipelined_with_wider_hgmma(results):
    """The sm_90 rows for any launch are pipelined, and their HGMMAs are at least 64 wide (forward and dq: 64 keys per
    warpgroup, or the head dim) or BLOCK_M wide (dk/dv: the query tile is the N of its transposed products), dense
    and packed, but where NARROW_HOPPER_LAUNCHES says otherwise."""
    hopper = BY_CAPABILITY[90]
    checked = 0
    for kernel, head_dim, tile in dict.fromkeys(_hopper_rows(scores_only=False) + _hopper_rows(False, "packed")):
        assert tile.num_stages >= 2, (kernel, head_dim, tile)
        for layout, variant in (("dense", ""), ("packed", "/varlen")):
            if plan(kernel, torch.bfloat16, head_dim, hopper, packed=layout == "packed").tile != tile:
                continue  # a row before this one serves that layout
            r = _row(results, f"attention_{kernel}", f"bf16/D{head_dim}/{tile}{variant}/tma", 90)
            narrowest = min(tile.block_m, head_dim) if kernel == "bwd_dkdv" else min(64, head_dim)
            narrowest = NARROW_HOPPER_LAUNCHES.get((kernel, head_dim, layout), narrowest)
            assert min(_hgmma_widths(r)) >= narrowest, (r.config, r.mma_counts)
            checked += 1
    assert checked == 2 * 7


def _row(results, name, config, target):
    rows = [r for r in results if r.name == name and r.config == config and r.target == target]
    assert len(rows) == 1, (name, config, target)
    return rows[0]


@pytest.mark.slow
def test_wide_tiles_on_hopper_run_hgmma_at_least_64_wide(results):
    """Light launches run HGMMAs of N >= 64 on sm_90, or the head dim where it is the N (p @ v, dq, dk, dv): 64 keys
    per warpgroup in the forward and dq, 64 query rows in the dk/dv tile (the N of its transposed products), in
    every variant such a launch runs: dense (/padded, /causal) and, where these rows serve packed sequences without a
    scores-only row of their own (test_packed_wide_tiles_on_hopper_...), /varlen/nodropout."""
    hopper = BY_CAPABILITY[90]
    checked = 0
    for kernel, head_dim, tile in _hopper_rows(scores_only=True):
        for variant, packed in (("/padded", False), ("/varlen/nodropout", True), ("/causal", False)):
            if plan(kernel, torch.bfloat16, head_dim, hopper, scores_only=True, packed=packed).tile != tile:
                continue  # packed launches with rows of their own (test_packed_wide_tiles_on_hopper_...) or none
            # where the launches that are not scores-only take the same tile, the report compiles theirs only
            if variant != "/causal" and tile == plan(kernel, torch.bfloat16, head_dim, hopper, packed=packed).tile:
                variant = "/varlen" if packed else ""
            r = _row(results, f"attention_{kernel}", f"bf16/D{head_dim}/{tile}{variant}/tma", 90)
            assert min(_hgmma_widths(r)) >= min(64, head_dim), (r.config, r.mma_counts)
            checked += 1
    assert checked == 5 * 3 + 5 * 3 + 4 * 3 - 1 - 3


@pytest.mark.slow
def test_packed_wide_tiles_on_hopper_run_wide_hgmma_with_little_more_bookkeeping(results):
    """Light packed launches whose wide tiles spill take rows of their own, in both variants that run them (the
    two-loop /varlen/causal and /varlen/nodropout): HGMMAs at least as wide as the tile's keys (forward; the head dim
    where that is less) or query rows (dk/dv, the N of its transposed products), and at most 1.5x the non-MMA
    instructions per kMAC of the dense launches' wide tiles in the matching variant (/causal, /padded). What packed
    launches ran before these tiles issued 2.3x (forward D128, every tile masked), 2.2x (dk/dv D64, every tile
    masked) and 2.3x (dk/dv D128, the general 16-row tiles). Where the tiles are the ones packed launches with dropout
    take, the report compiles /varlen/nodropout as /varlen (with dropout): /varlen/causal only."""
    hopper = BY_CAPABILITY[90]
    checked = 0
    for kernel, head_dim, tile in _hopper_rows(scores_only=True, layout="packed"):
        if (kernel, head_dim, tile) in _hopper_rows(scores_only=True):
            continue  # serves dense launches too: test_wide_tiles_on_hopper_run_hgmma_at_least_64_wide
        narrowest = tile.block_m if kernel == "bwd_dkdv" else min(tile.block_n, head_dim)
        dense = plan(kernel, torch.bfloat16, head_dim, hopper, scores_only=True).tile
        general = plan(kernel, torch.bfloat16, head_dim, hopper, packed=True).tile
        variants = [("/varlen/causal", "/causal")]
        if tile != general:
            variants.append(("/varlen/nodropout", "/padded"))
        for variant, dense_variant in variants:
            r = _row(results, f"attention_{kernel}", f"bf16/D{head_dim}/{tile}{variant}/tma", 90)
            assert min(_hgmma_widths(r)) >= narrowest, (r.config, r.mma_counts)
            wide = _row(results, f"attention_{kernel}", f"bf16/D{head_dim}/{dense}{dense_variant}/tma", 90)
            assert r.non_mma_per_kmac <= 1.5 * wide.non_mma_per_kmac, (r.config, r.non_mma_per_kmac, wide.config)
            checked += 1
    assert checked == 5


@pytest.mark.slow
def test_plain_forward_on_hopper_runs_less_bookkeeping(results):
    """The plain forward's sm_90 tiles (scores-only launches, the /causal variant) are pipelined, and their main loop
    issues fewer non-MMA instructions per kMAC than the general tiles' on sm_80 (the figure that compares the two)."""
    for kernel, head_dim, tile in _hopper_rows(scores_only=True):
        if kernel != "fwd":
            continue
        r = _row(results, "attention_fwd", f"bf16/D{head_dim}/{tile}/causal/tma", 90)
        assert tile.num_stages >= 2
        general = plan("fwd", torch.bfloat16, head_dim, BY_CAPABILITY[80], scores_only=True).tile
        sm80 = _row(results, "attention_fwd", f"bf16/D{head_dim}/{general}/causal", 80)
        assert r.non_mma_per_kmac < sm80.non_mma_per_kmac, (r.config, r.non_mma_per_kmac, sm80.non_mma_per_kmac)


@pytest.mark.slow
def test_exact_float32_attention_has_no_mma(results):
    exact = [r for r in results if r.name.startswith("attention_") and r.config.startswith("fp32/")]
    assert exact and all(not r.mma_counts and r.loop_mma_instructions == 0 for r in exact)


@pytest.mark.slow
def test_every_kernel_with_mmas_has_a_main_loop(results):
    # The weights kernel computes one (query tile, key tile) block per program: no loop.
    with_mma = [r for r in results if r.mma_counts and r.name != "attention_weights"]
    assert {r.name for r in with_mma} >= {"attention_fwd", "attention_bwd_dq", "attention_bwd_dkdv"}
    for r in with_mma:
        assert 0 < r.loop_mma_instructions < r.loop_instructions, (r.name, r.config, r.target)
        assert r.loop_mma_instructions <= sum(count for _, count in r.mma_counts)
        assert r.non_mma_per_mma > 0 and r.non_mma_per_kmac > 0


@pytest.mark.slow
def test_every_config_fits_on_an_sm(results):
    for r in results:
        assert 1 <= r.blocks_per_sm and r.warps_per_sm == r.blocks_per_sm * r.num_warps, (r.name, r.config, r.target)
        assert r.warps_per_sm <= report.SM_LIMITS[r.target].max_warps_per_sm


@pytest.mark.slow
def test_pipelined_attention_copies_with_cp_async_before_hopper(results):
    staged = [r for r in _attention_16_bit(results)
              if int(re.search(r"_s(\d+)", r.config).group(1)) > 1 and r.target < 90]
    assert {r.name for r in staged} >= {"attention_fwd"}
    assert all("LDGSTS" in r.async_copy for r in staged), [(r.name, r.config, r.async_copy) for r in staged]


@pytest.mark.slow
def test_16_bit_attention_loads_through_tma_on_hopper_only(results):
    """On sm_90 every 16-bit attention kernel (the probabilities kernel included) is compiled as the launcher runs it
    there, q/k/v (and o/do in the backward) through TMA descriptors; before sm_90 none uses TMA. The float mask, read
    through any strides, still comes by cp.async (UTMALDG+LDGSTS). The decode kernels gather keys (pages, splits)
    through pointers on every target."""
    decode = [r for r in results if r.name.startswith("attention_decode")]
    assert decode and not any("UTMALDG" in r.async_copy for r in decode)
    attention_16_bit = [r for r in results if r.name.startswith("attention_") and r.config.startswith("bf16/")
                        and r not in decode]
    hopper = [r for r in attention_16_bit if r.target == 90]
    assert {r.name for r in hopper} == {"attention_fwd", "attention_bwd_dq", "attention_bwd_dkdv",
                                        "attention_weights"}
    for r in attention_16_bit:  # the plan's variant, if any, follows a "+"
        assert (r.target == 90) == r.config.split("+")[0].endswith("/tma") == ("UTMALDG" in r.async_copy), (
            r.name, r.config, r.target, r.async_copy)


@pytest.mark.slow
def test_tf32_forward_on_sm_90_runs_wgmma_through_tma_at_its_head_dims(results):
    """The forward in tf32 at configs.TF32_TMA_HEAD_DIMS on sm_90 loads through TMA and runs its products as wgmma
    (HGMMA...TF32), every variant; the other head dims and targets, and the backward, keep the pointer path."""
    tf32 = [r for r in results if r.name.startswith("attention_") and r.config.startswith("tf32/")]
    assert {r.name for r in tf32 if r.config.endswith("/tma")} == {"attention_fwd"}
    for r in tf32:
        head_dim = int(re.search(r"/D(\d+)/", r.config).group(1))
        takes_tma = r.name == "attention_fwd" and r.target == 90 and head_dim in configs.TF32_TMA_HEAD_DIMS
        assert takes_tma == r.config.endswith("/tma") == ("UTMALDG" in r.async_copy), (r.name, r.config, r.target)
        if takes_tma:
            shapes = [opcode for opcode, _ in r.mma_counts]
            assert shapes and all(re.fullmatch(r"HGMMA\.64x\d+x8\.F32\.TF32", o) for o in shapes), (r.config, shapes)


# -------------------------------------------------------------------------------- SASS figures, hand-written SASS


def _sass(*instructions: str) -> str:
    """cuobjdump -sass listing of ``instructions``, one every 16 bytes from address 0, with encoding lines."""
    lines = ["", "\tcode for sm_80", "\t\tFunction : kernel"]
    for index, text in enumerate(instructions):
        lines.append(f"        /*{16 * index:04x}*/                   {text} ;                /* 0x000fe400078e00ff */")
        lines.append("                                                                  /* 0x000fe20000000000 */")
    return "\n".join(lines)


_NESTED_LOOPS = _sass(
    "S2R R0, SR_TID.X",                         # 0x00
    "LDGSTS.E.BYPASS.128 [R2+0x4000], [R4.64]",  # 0x10
    "LDGDEPBAR",                                 # 0x20
    "HMMA.16816.F32.BF16 R8, R12, R16, RZ",      # 0x30  before the loops
    "IMAD R0, R0, 0x2, RZ",                      # 0x40  outer loop
    "HMMA.16816.F32.BF16 R8, R12, R16, R8",      # 0x50  inner loop
    "HMMA.16816.F32.BF16 R8, R14, R18, R8",      # 0x60
    "FFMA R20, R8, R9, R20",                     # 0x70
    "@P0 BRA 0x50",                              # 0x80  inner back edge
    "@!P1 BRA 0xd0",                             # 0x90  forward branch: no loop
    "IADD3 R0, R0, 0x1, RZ",                     # 0xa0
    "@!P2 BRA 0x40",                             # 0xb0  outer back edge
    "EXIT",                                      # 0xc0
    "BRA 0xd0",                                  # 0xd0  the trap after EXIT: a branch to itself
)


def test_main_loop_is_the_innermost_loop_with_the_most_mmas():
    instructions = sass.parse_sass(_NESTED_LOOPS)
    assert len(instructions) == 14 and instructions[8].opcode == "BRA" and instructions[8].operands == "0x50"
    first, last = sass.main_loop(instructions)
    assert (instructions[first].address, instructions[last].address) == (0x50, 0x80)
    figures = sass.analyse_sass(_NESTED_LOOPS)
    assert (figures.loop_instructions, figures.loop_mma_instructions) == (4, 2)
    assert figures.loop_macs_per_warp == 2 * 16 * 8 * 16
    assert figures.mma_counts == (("HMMA.16816.F32.BF16", 3),)
    result = report.AotResult(module="m", name="k", config="c", target=80, num_warps=4,
                              **dataclasses.asdict(figures))
    assert result.non_mma_per_mma == 1.0  # 2 other instructions, 2 MMAs
    assert result.non_mma_per_kmac == 2 * 1024 / 4096


def test_main_loop_is_the_innermost_loop_with_the_most_mmas_even_when_an_outer_loop_has_more():
    listing = _sass(
        "HMMA.1688.F32.TF32 R8, R12, R16, R8",   # 0x00  outer loop, 4 MMAs in all
        "HMMA.1688.F32.TF32 R8, R12, R16, R8",   # 0x10  inner loop A: 1 MMA
        "@P0 BRA 0x10",                          # 0x20
        "HMMA.1688.F32.TF32 R8, R12, R16, R8",   # 0x30  inner loop B: 2 MMAs in 4 instructions
        "HMMA.1688.F32.TF32 R8, R12, R16, R8",   # 0x40
        "FMUL R1, R1, R2",                       # 0x50
        "@P1 BRA 0x30",                          # 0x60
        "@P2 BRA 0x0",                           # 0x70
        "EXIT",
    )
    figures = sass.analyse_sass(listing)
    assert (figures.loop_instructions, figures.loop_mma_instructions) == (4, 2)
    assert figures.loop_macs_per_warp == 2 * 16 * 8 * 8


def test_jumps_back_from_out_of_line_code_are_no_loops():
    # ptxas puts mbarrier wait retries after the kernel's EXIT: a forward jump there, a spin, a jump back.
    listing = _sass(
        "@!P0 BRA 0x80",                                      # 0x00  to the out-of-line wait
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT",  # 0x10  the loop
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0",  # 0x20
        "@P1 BRA 0x10",                                       # 0x30
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0",  # 0x40
        "@!P3 EXIT",                                          # 0x50  a predicated EXIT does not end the kernel
        "EXIT",                                               # 0x60
        "BRA 0x70",                                           # 0x70
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2",       # 0x80  out-of-line wait
        "@!P0 BRA 0x80",                                      # 0x90
        "BRA 0x10",                                           # 0xa0  back into the kernel: no loop
    )
    instructions = sass.parse_sass(listing)
    assert instructions[5].predicate == "!P3" and instructions[6].predicate == ""
    assert sass.loops(instructions) == [(1, 3)]
    assert (sass.analyse_sass(listing).loop_instructions, sass.analyse_sass(listing).loop_mma_instructions) == (3, 2)


def test_main_loop_prefers_the_loop_with_more_mmas():
    listing = _sass(
        "HMMA.16816.F32.BF16 R8, R12, R16, R8",  # 0x00  loop A: 1 MMA in 2 instructions
        "@P0 BRA 0x0",                           # 0x10
        "HMMA.16816.F32.BF16 R8, R12, R16, R8",  # 0x20  loop B: 2 MMAs in 4 instructions
        "HMMA.16816.F32.BF16 R8, R12, R16, R8",  # 0x30
        "FMUL R1, R1, R2",                       # 0x40
        "@P1 BRA 0x20",                          # 0x50
        "EXIT",
    )
    figures = sass.analyse_sass(listing)
    assert (figures.loop_instructions, figures.loop_mma_instructions) == (4, 2)


def test_no_main_loop_without_mmas_in_a_loop():
    listing = _sass("HMMA.16816.F32 R8, R12, R16, RZ", "FADD R1, R1, R2", "@P0 BRA 0x10", "EXIT", "BRA 0x40")
    figures = sass.analyse_sass(listing)
    assert (figures.loop_instructions, figures.loop_mma_instructions, figures.loop_macs_per_warp) == (0, 0, 0)
    assert figures.mma_counts == (("HMMA.16816.F32", 1),)
    result = report.AotResult(module="m", name="k", config="c", target=80, num_warps=4, **dataclasses.asdict(figures))
    assert result.non_mma_per_mma is None and result.non_mma_per_kmac is None
    assert sass.main_loop(sass.parse_sass(_sass("FADD R1, R1, R2", "@P0 BRA 0x0"))) is None


@pytest.mark.parametrize("opcode, macs_per_warp", [
    ("HMMA.16816.F32.BF16", 16 * 8 * 16),
    ("HMMA.16816.F32", 16 * 8 * 16),
    ("HMMA.1688.F32.TF32", 16 * 8 * 8),
    ("HMMA.1684.F32.TF32", 16 * 8 * 4),
    ("HGMMA.64x128x16.F32.BF16", 64 * 128 * 16 // 4),  # one warpgroup instruction, issued by its 4 warps
    ("HGMMA.64x8x16.F32.BF16", 64 * 8 * 16 // 4),
    ("HGMMA.64x32x8.F32.TF32", 64 * 32 * 8 // 4),
    ("FFMA", 0), ("HFMA2.MMA", 0), ("IMAD", 0),
])
def test_mma_shapes(opcode, macs_per_warp):
    assert sass.mma_macs_per_warp(opcode) == macs_per_warp


def test_hgmma_counts_widest_first_and_per_warpgroup_macs():
    listing = _sass(
        "WARPGROUP.ARRIVE",
        "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT",
        "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR12], R24, gsb0",
        "HGMMA.64x128x16.F32.BF16 R56, R88, gdesc[UR16].tnspB, R56, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "UTMALDG.2D [UR8], [UR4]",
        "@!P0 BRA 0x10",
    )
    figures = sass.analyse_sass(listing)
    assert figures.mma_counts == (("HGMMA.64x128x16.F32.BF16", 1), ("HGMMA.64x32x16.F32.BF16", 2))
    assert report.format_mma(figures.mma_counts) == "HGMMA.64x128x16.F32.BF16 x1, HGMMA.64x32x16.F32.BF16 x2"
    assert (figures.loop_instructions, figures.loop_mma_instructions) == (6, 3)
    assert figures.loop_macs_per_warp == (2 * 64 * 32 * 16 + 64 * 128 * 16) // 4
    assert figures.async_copy == "UTMALDG"


def test_serialized_hgmma_chain_is_a_problem():
    # As ptxas emits a product it serializes (C7515): each K step waits for the one before.
    serialized = _sass(
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24], RZ, !UPT, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR28].tnspB, R88, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R88, R32, gdesc[UR28].tnspB, R88, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "@!P0 BRA 0x0",
    )
    assert sass.analyse_sass(serialized).serialized_mmas == 2
    result = report.AotResult(module="m", name="k", config="c", target=90, num_warps=8, serialized_mmas=2)
    assert result.problems == ["wgmma serialized (2 HGMMA wait for the one before)"]


def test_pipelined_hgmma_chains_are_not_serialized():
    # One wait per product; a product that starts from zero (RZ) or accumulates into another register (the P @ V
    # product onto the accumulator of the last iteration, after the scores' wait) is a new chain.
    pipelined = _sass(
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR8].tnspB, R88",
        "HGMMA.64x128x16.F32.BF16 R88, R156, gdesc[UR8].tnspB, R88, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "@!P0 BRA 0x0",
    )
    assert sass.analyse_sass(pipelined).serialized_mmas == 0


@pytest.mark.parametrize("instructions, kind", [
    (("LDGSTS.E.BYPASS.128 [R2+0x4000], [R4.64], P5", "LDGDEPBAR", "LDG.E.U8 R1, [R2.64]"), "LDGSTS"),
    (("UTMALDG.2D [UR8], [UR4]", "LDGSTS.E.128 [R2], [R4.64]"), "UTMALDG+LDGSTS"),
    (("LDG.E.128 R4, [R2.64]", "STS.128 [R1], R4"), "LDG"),
    (("LDS R4, [R2]", "STG.E [R2.64], R4"), "-"),
])
def test_async_copy_kind(instructions, kind):
    assert sass.analyse_sass(_sass(*instructions)).async_copy == kind


@pytest.mark.parametrize("target, num_warps, registers, shared_bytes, blocks, warps", [
    (80, 8, 32, 0, 8, 64),            # 256 threads x 32 registers: every warp slot
    (80, 8, 64, 0, 4, 32),            # register-bound: 2048 registers per warp, 8 warps per scheduler
    (80, 4, 33, 0, 12, 48),           # 33 x 32 = 1056 registers rounds up to 1280 per warp: 12 per scheduler
    (80, 8, 255, 0, 1, 8),            # 8192 registers per warp
    (80, 16, 255, 0, 0, 0),           # over the 65536 registers one block may have
    (80, 1, 16, 0, 32, 32),           # block-count bound: 32 blocks on sm_80 and sm_90,
    (90, 1, 16, 0, 32, 32),
    (86, 1, 16, 0, 16, 16),           # 16 on sm_86,
    (89, 1, 16, 0, 24, 24),           # 24 on sm_89
    (86, 8, 32, 0, 6, 48),            # 48 warp slots on sm_86 / sm_89
    (80, 8, 32, 48 * 1024, 3, 24),    # shared-memory bound: 49152 + 1024 reserved per block, 164 KB per SM
    (80, 8, 255, 114688, 1, 8),
    (90, 4, 128, 100 * 1024, 2, 8),   # 228 KB per SM holds two blocks of 100 KB + 1 KB
    (86, 4, 64, 49 * 1024, 2, 8),     # 100 KB per SM holds two blocks of 49 KB + 1 KB
    (86, 4, 64, 50 * 1024, 1, 4),     # but not two of 50 KB + 1 KB
])
def test_occupancy(target, num_warps, registers, shared_bytes, blocks, warps):
    assert report.occupancy(target, num_warps, registers, shared_bytes) == (blocks, warps)


def test_table_has_the_sass_columns():
    figures = sass.analyse_sass(_NESTED_LOOPS)
    result = report.AotResult(module="m", name="k", config="c", target=80, num_warps=4, registers=64,
                              blocks_per_sm=4, warps_per_sm=16, **dataclasses.asdict(figures))
    header, _, row = report.format_table([result]).splitlines()
    for column in ("blocks/SM", "warps/SM", "MMA", "copy", "loop instr/MMA", "non-MMA/MMA", "non-MMA/kMAC"):
        assert column in header
    assert row.split() == ["k", "c", "sm_80", "4", "64", "0", "0", "4", "16", "HMMA.16816.F32.BF16", "x3", "LDGSTS",
                           "4/2", "1.0", "0.5", "OK"]
