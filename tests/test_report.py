"""AOT compile of every shipped kernel config for sm_80 / 86 / 89 / 90 (no GPU needed): no spills, shared memory within
the limits, tensor cores where expected; and the AOT lists cover every config the launchers can pick.

Compilation runs in spawned workers (this process interprets Triton); Triton's on-disk cache makes reruns fast.
"""
import importlib

import pytest
import torch

from fused_transformer.tools import report
from fused_transformer.kernels import feed_forward, layer_norm


@pytest.fixture(scope="module")
def results():
    return report.compile_all(jobs=2)


def test_every_shipped_config_compiles_within_limits(results):
    expected_jobs = report.jobs_for(report.KERNEL_MODULES)
    assert len(results) == len(expected_jobs)
    failed = [r for r in results if not r.ok]
    assert not failed, "\n" + report.format_table(failed)


def test_matmuls_use_tensor_cores(results):
    matmuls = [r for r in results if r.expect_tensor_cores]
    assert matmuls, "no kernel expects tensor cores: the fp16/bf16 matmul configs are missing"
    assert all(r.tensor_cores for r in matmuls)


def test_hopper_and_ampere_configs_compile_only_for_their_target(results):
    for r in results:
        if r.module.endswith("feed_forward"):  # sm_86 / sm_89 run the sm_80 configs
            assert r.config.startswith("sm_90/" if r.target == 90 else "sm_80/"), (r.config, r.target)


def test_every_target_users_have_is_compiled(results):
    assert {r.target for r in results} == {80, 86, 89, 90}
    by_kernel = {}
    for r in results:
        by_kernel.setdefault(r.name, set()).add(r.target)
    assert all(targets == {80, 86, 89, 90} for targets in by_kernel.values()), by_kernel


def test_attention_on_99_kb_parts_picks_tiles_that_fit(monkeypatch):
    from fused_transformer.kernels import attention

    monkeypatch.setattr(attention, "interpreting", lambda: False)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(attention, "shared_memory_per_block", lambda device: 101376)
    small = attention.config_for("fwd", torch.bfloat16, 64, cuda)
    monkeypatch.setattr(attention, "shared_memory_per_block", lambda device: 166912)
    large = attention.config_for("fwd", torch.bfloat16, 64, cuda)
    assert (small.num_stages, large.num_stages) == (2, 3)  # the report compiles both for their targets


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
    bwd = {(k.constexprs["BLOCK_N"], k.constexprs["SPLIT_COLS"], k.num_warps) for k in configs
           if k.name == "layer_norm_bwd"}
    for n in _hidden_sizes():
        block_n = layer_norm._block_n(n)
        assert (block_n, layer_norm._num_warps(block_n)) in fwd, n
        bwd_block = layer_norm._bwd_block_n(n)
        split = -(-n // bwd_block) > 1
        assert (bwd_block, split, layer_norm._bwd_num_warps(bwd_block, split)) in bwd, n
    assert any(k.name == "sum_rows" for k in configs)


def test_layer_norm_configs_do_not_depend_on_the_interpreter():
    # This process interprets Triton (one warp per launch); the AOT list must hold the GPU's warps.
    warps = {k.constexprs["BLOCK_N"]: k.num_warps for k in layer_norm.aot_configs() if k.name == "layer_norm_fwd"}
    assert warps[16384] == layer_norm._num_warps(16384) > 1


def test_feed_forward_configs_cover_every_matmul_config():
    configs = feed_forward.aot_configs()
    for (generation, dtype, fused), cfg in feed_forward.MATMUL_CONFIGS.items():
        described = feed_forward._describe(cfg)
        matching = [k for k in configs if k.config.endswith(described) and k.config.startswith(generation)
                    and k.targets == feed_forward._TARGETS[generation]]
        variants = {k.name for k in matching}
        if fused:
            assert {"ffn_matmul_linear1_fwd", "ffn_matmul_dpre_bwd"} <= variants, (generation, dtype)
        else:
            assert {"ffn_matmul_linear2_fwd", "ffn_matmul_weight_grad", "ffn_matmul_input_grad"} <= variants
        for k in matching:
            assert (k.num_warps, k.num_stages) == (cfg.num_warps, cfg.num_stages)
            assert k.expect_tensor_cores == (dtype != torch.float32)


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


def test_report_command_prints_every_kernel_and_config(results, monkeypatch, capsys):
    from fused_transformer.__main__ import main

    monkeypatch.setattr(report, "compile_all", lambda jobs, modules: [r for r in results if r.module in modules])
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    for module in report.KERNEL_MODULES:
        for kernel in importlib.import_module(module).aot_configs():
            assert kernel.name in out
    for r in results:
        assert r.config in out
    assert "sm_80" in out and "sm_90" in out
    assert f"{len(results)} compilations, 0 failed" in out


def test_report_command_exits_1_when_a_compilation_fails(results, monkeypatch, capsys):
    from dataclasses import replace

    from fused_transformer.__main__ import main

    broken = [replace(results[0], spill_bytes=8)] + list(results[1:])
    monkeypatch.setattr(report, "compile_all", lambda jobs, modules: broken)
    assert main(["report"]) == 1
    assert "1 failed" in capsys.readouterr().out


def test_attention_configs_cover_every_tile_the_launchers_pick(monkeypatch):
    """Whatever tiles config_for picks (dtype, head dim, 99 KB or larger shared memory, allow_tf32) is compiled by
    the report for the targets that pick it."""
    from fused_transformer.kernels import attention

    monkeypatch.setattr(attention, "interpreting", lambda: False)
    listed = {(k.name, k.config, target) for k in attention.aot_configs() for target in k.targets}
    cuda = torch.device("cuda", 0)
    checked = 0
    for shared_memory, targets in ((166912, (80, 90)), (101376, (86, 89))):
        monkeypatch.setattr(attention, "shared_memory_per_block", lambda device, size=shared_memory: size)
        for kernel in ("fwd", "bwd_dq", "bwd_dkdv", "weights"):
            for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp32", torch.float32, False),
                                      ("tf32", torch.float32, True)):
                if kernel == "weights" and tf32:  # the weights kernel never runs in tf32
                    continue
                for head_dim in (16, 32, 64, 128, 256):
                    if dtype == torch.float32 and head_dim > attention.MAX_HEAD_DIM_FLOAT32:
                        continue
                    cfg = attention.config_for(kernel, dtype, head_dim, cuda, tf32)
                    config = f"{name}/D{head_dim}/BM{cfg.block_m}_BN{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}"
                    for target in targets:
                        assert (f"attention_{kernel}", config, target) in listed
                        checked += 1
    assert checked == 2 * 2 * (5 + 4 * 2) * 3 + 2 * 2 * (5 + 4)
