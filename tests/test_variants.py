"""Kernel variants (kernels/variants.py): the registry, the measured rows the plans read, the attention plan's
variants and refusals, the decode split rules, the AOT report's variant configs, and the bench's variants suite
under the interpreter."""
import json

import pytest
import torch

from fused_transformer.kernels import layer_norm, variants  # noqa: F401 (layer_norm registers its variants)
from fused_transformer.kernels._common import interpreting
from fused_transformer.kernels.attention import aot, configs, decode
from fused_transformer.kernels.targets import TARGETS
from fused_transformer.tools import bench
from fused_transformer.tools.report import AotResult

HOPPER = next(t for t in TARGETS if t.capability == 90)


@pytest.fixture
def rows_file(tmp_path, monkeypatch):
    """An empty variants file standing for the package's."""
    path = tmp_path / "variant_rows.json"
    monkeypatch.setattr(variants, "MEASURED_FILE", str(path))
    variants.forget_rows()
    yield path
    variants.forget_rows()


def _row(op="attention.fwd", gpu="H200", shape="bf16/D128/causal/L4096", variant="persistent"):
    return variants.VariantRow(op, gpu, shape, variant, 0.9, 1.1, "sdpa:cudnn_attention", "H200 test 2026-12-06")


def test_every_op_registers_a_default_that_builds():
    ops = variants.registered()
    assert {"attention.fwd", "attention.bwd", "decode.split", "layer_norm.fwd", "layer_norm.bwd"} <= set(ops)
    assert set(ops["attention.bwd"][1]) == {"tiles", "heaviest_first", "deep_pipeline"}
    for op, (default, refusals) in ops.items():
        assert refusals[default] == "", op


def test_without_rows_the_default_runs_and_status_says_so(rows_file):
    assert not variants.deciding("attention.fwd")
    assert variants.choose("attention.fwd", "H200", "bf16/D128/causal/L4096") == configs.DEFAULT_VARIANT
    assert any("unmeasured" in line and line.startswith("attention.fwd") for line in variants.status())


def test_a_measured_row_picks_its_variant_on_its_gpu_and_shape_only(rows_file):
    variants.write_rows([_row()], str(rows_file))
    assert variants.deciding("attention.fwd") and not variants.deciding("decode.split")
    assert variants.choose("attention.fwd", "H200", "bf16/D128/causal/L4096") == "persistent"
    assert variants.choose("attention.fwd", "H100", "bf16/D128/causal/L4096") == configs.DEFAULT_VARIANT
    assert variants.choose("attention.fwd", "H200", "bf16/D128/none/L4096") == configs.DEFAULT_VARIANT
    assert any("measured on H200" in line for line in variants.status())


def test_writing_rows_keeps_the_other_gpus_rows(rows_file):
    variants.write_rows([_row(gpu="H100"), _row(gpu="H200")], str(rows_file))
    variants.write_rows([_row(gpu="H200", variant="heaviest_first")], str(rows_file))
    kept = {(row.gpu, row.variant) for row in variants.read_rows(str(rows_file))}
    assert kept == {("H100", "persistent"), ("H200", "heaviest_first")}


def test_a_row_naming_a_refused_or_unknown_variant_is_ignored(rows_file):
    variants.write_rows([_row(variant="warp_specialized"), _row(shape="bf16/D64/none/L1024", variant="nope")],
                        str(rows_file))
    assert variants.choose("attention.fwd", "H200", "bf16/D128/causal/L4096") == configs.DEFAULT_VARIANT
    assert variants.choose("attention.fwd", "H200", "bf16/D64/none/L1024") == configs.DEFAULT_VARIANT


def test_a_malformed_rows_file_is_a_clear_error(rows_file):
    rows_file.write_text(json.dumps({"rows": [{"op": "attention.fwd"}]}))
    with pytest.raises(ValueError, match="lacks a field"):
        variants.read_rows(str(rows_file))


def test_forcing_checks_the_op_and_the_variant():
    with variants.forced({"attention.fwd": "persistent"}):
        assert variants.choose("attention.fwd", "H200", "any") == "persistent"
        assert variants.deciding("decode.split")
    assert variants.forcing() == {}
    with pytest.raises(ValueError, match="no op"):
        with variants.forced({"attention.bwd_typo": "tiles"}):
            pass
    with pytest.raises(ValueError, match="has no variant"):
        with variants.forced({"attention.fwd": "fastest"}):
            pass
    with pytest.raises(ValueError, match="refuses .*warp_specialized.*Triton"):
        with variants.forced({"attention.fwd": "warp_specialized"}):
            pass


def test_the_plan_refuses_the_warp_specialized_variants_with_the_reason():
    for name in ("warp_specialized", "pingpong"):
        with pytest.raises(ValueError, match="refused: .*setmaxnreg"):
            configs.plan("fwd", torch.bfloat16, 128, HOPPER, scores_only=True, variant=name)
    planned = configs.plan("fwd", torch.bfloat16, 128, HOPPER, scores_only=True, variant="warp_specialized",
                           refused_too=True)
    assert planned.warp_specialize and planned.constexprs()["WARP_SPECIALIZE"]


def test_the_variants_own_rows_come_first_where_they_serve():
    deep = configs.plan("fwd", torch.bfloat16, 64, HOPPER, scores_only=True, variant="deep_pipeline")
    default = configs.plan("fwd", torch.bfloat16, 64, HOPPER, scores_only=True)
    assert deep.variant == "deep_pipeline" and deep.tile.num_stages == default.tile.num_stages + 1
    ampere = next(t for t in TARGETS if t.capability == 80)
    assert configs.plan("fwd", torch.bfloat16, 64, ampere, scores_only=True, variant="deep_pipeline").variant == "tiles"
    persistent = configs.plan("fwd", torch.bfloat16, 64, ampere, scores_only=True, variant="persistent")
    assert persistent.tile_order == configs.PERSISTENT and persistent.constexprs()["TILE_ORDER"] == configs.PERSISTENT


def test_shape_classes_bucket_lengths_and_head_dims():
    assert configs.shape_class(torch.float16, 100, 3000, True, True) == "bf16/D128/causal/L4096"
    assert configs.shape_class(torch.bfloat16, 64, 100, False, False) == "bf16/D64/none/masked/L1024"
    assert configs.shape_class(torch.float32, 64, 10 ** 6, False, True) == "fp32/D64/none/L16384"
    assert decode.shape_class(8, 8, 8192) == "P64/L8192"


@pytest.mark.parametrize("rule", decode.SPLIT_RULES)
def test_decode_split_rules_stay_within_the_key_blocks(rule):
    for batch in (1, 2, 3, 8, 17, 32):
        for keys in (64, 1000, 8192, 32768):
            splits = decode.decode_splits(batch, 8, 1, keys, 132, 64, rule)
            assert 1 <= splits <= min(-(-keys // 64), decode.MAX_SPLITS)
            if batch * 8 >= 132:
                assert splits == 1


def test_full_waves_fills_the_sms_better_than_one_more_split_would():
    # 64 programs on 132 SMs: 2 splits keep 97% of them busy in one wave, 3 spill into a half-empty second wave.
    assert decode.decode_splits(8, 8, 1, 8192, 132, 64, "fill_sms") == 3
    assert decode.decode_splits(8, 8, 1, 8192, 132, 64, "full_waves") == 2
    with pytest.raises(ValueError, match="split rule"):
        decode.decode_splits(8, 8, 1, 8192, 132, 64, "random")


def test_the_report_compiles_each_variant_where_it_changes_the_launch():
    shipped = aot.aot_configs()
    variant_configs = [k for k in shipped if "+" in k.config]
    names = {k.config.rsplit("+", 1)[1] for k in variant_configs}
    assert names == {v.name for v in configs.VARIANTS if v.name != "tiles" and not v.builds_on}
    for k in variant_configs:
        variant = configs.VARIANTS_BY_NAME[k.config.rsplit("+", 1)[1]]
        assert k.name[len("attention_"):] in variant.kernels and k.config.startswith(("bf16/D64/", "bf16/D128/"))
        assert k.expect_instructions == variant.claims and k.refused == variant.refused
        assert set(k.targets) <= set(variant.targets)
        assert k.constexprs.get("TILE_ORDER", configs.GRID_ORDER) == variant.tile_order
    # dk/dv's one variant row holds from Triton 3.7 (it spills under 3.6): the forward and dq have some under every one
    assert {"attention_fwd", "attention_bwd_dq"} <= {k.name for k in variant_configs}
    assert all(not k.expect_instructions and not k.refused for k in shipped if "+" not in k.config)


def test_a_refused_variant_passes_the_report_only_while_it_does_not_build():
    common = dict(module="attention", name="attention_fwd", config="c", target=90, num_warps=8)
    assert AotResult(**common, refused=True, error="PassManager::run failed").ok
    assert AotResult(**common, refused=True, missing_instructions=("USETMAXREG",)).ok
    assert not AotResult(**common, refused=True).ok
    assert not AotResult(**common, missing_instructions=("UTMALDG",)).ok


@pytest.mark.parametrize("rule", decode.SPLIT_RULES)
def test_each_split_rule_decodes_as_the_reference(rule):
    """One query per sequence over 512 cached keys in 2 KV heads: under the interpreter's 16-key tiles "fill_sms" takes
    32 splits and "full_waves" 28 (for an H100's 132 SMs), each merged back to the reference's answer."""
    import fused_transformer as ft
    from tests.numerics import DEVICE, assert_close_to_reference

    assert decode.decode_splits(1, 2, 1, 512, 132, 16, "fill_sms") == 32
    assert decode.decode_splits(1, 2, 1, 512, 132, 16, "full_waves") == 28
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64)
               for shape in ((1, 1, 4, 16), (1, 512, 2, 16), (1, 512, 2, 16)))
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    baseline = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), enable_gqa=True).transpose(1, 2)
    with variants.forced({"decode.split": rule}), ft.use_backend("triton"):
        out = ft.attention_with_kvcache(*(t.float().to(DEVICE) for t in (q, k, v)),
                                        cache_seqlens=torch.tensor([512], dtype=torch.int32))
    assert_close_to_reference(out.cpu(), reference, baseline, f"decode ({rule})")


@pytest.mark.skipif(not interpreting(), reason="the CPU's tiny case runs our Triton kernels under the interpreter")
def test_the_variants_suite_runs_under_the_interpreter_and_writes_rows(tmp_path, capsys):
    rows_path = tmp_path / "rows.json"
    status = bench.main(["--suite", "variants", "--device", "cpu", "--quick", "--no-plots", "--no-progress",
                         "--backend", "triton",
                         "--min-time", "0.01", "--out", str(tmp_path), "--variant-rows", str(rows_path)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    found = variants.read_rows(str(rows_path))
    assert {row.op for row in found} == {"attention.fwd", "attention.bwd", "layer_norm.fwd", "layer_norm.bwd",
                                         "decode.split"}
    assert all(row.gpu == "cpu" and row.vs_default <= 1.0 and "interpreter" in row.provenance for row in found)
    timed = (tmp_path / "bench_cpu.csv").read_text()
    for variant in ("tiles", "heaviest_first", "persistent"):
        assert f"attention.fwd bf16/D64/causal/L1024,fwd,variant:{variant}" in timed
    for variant in ("tiles", "heaviest_first"):
        assert f"attention.bwd bf16/D64/causal/L1024,fwd+bwd,variant:{variant}" in timed
    assert "FAILED" not in timed
