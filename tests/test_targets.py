"""Which GPU is this: kernels/targets.py maps every device to one of the targets the report checks, and the
launchers read it from there."""
import pytest
import torch

from fused_transformer.kernels import layer_norm, toolchain
from fused_transformer.kernels.targets import BY_CAPABILITY, CAPABILITIES, TARGETS, closest_target


def test_known_targets_map_to_themselves():
    for target in TARGETS:
        assert closest_target(target.capability, target.shared_memory) is target
    assert CAPABILITIES == (80, 86, 89, 90)
    assert [t.tma for t in TARGETS] == [t.clusters for t in TARGETS] == [False, False, False, True]


@pytest.mark.parametrize("capability, shared_memory, expected", [
    (100, 232448, 90),  # B200: Hopper's plans, not Ampere's
    (103, 232448, 90),
    (120, 101376, 89),  # RTX 50: TMA, but 99 KB of shared memory, so not Hopper's tiles
    (87, 166912, 86),  # Orin
    (75, 65536, 80),  # older than every target: the oldest
])
def test_an_unknown_gpu_gets_the_closest_known_target(capability, shared_memory, expected):
    assert closest_target(capability, shared_memory) is BY_CAPABILITY[expected]


def test_layer_norm_clusters_follow_the_target(monkeypatch):
    monkeypatch.setattr(layer_norm, "interpreting", lambda: False)
    for capability, clusters in ((80, False), (89, False), (90, True), (100, True)):
        target = closest_target(capability, 232448 if capability >= 90 else 101376)
        monkeypatch.setattr(layer_norm, "target_of", lambda device: target)
        expected = clusters and toolchain.cluster_launches(toolchain.installed())  # the GPU's and this Triton's
        assert layer_norm.launches_clusters(torch.device("cuda", 0)) is expected
