"""A process of the distributed tests in test_drop_in.py: trains a torch.nn Transformer encoder and its fused twin
(same initial weights) for a few steps under DDP or FSDP2 on the gloo backend, each rank on its own data, and
saves both models' final parameters. Its own module so that spawned processes can import it."""
import gc
import os

import torch
import torch.distributed as dist
from torch import nn

D_MODEL, HEADS, FF, LAYERS, STEPS = 32, 4, 64, 2, 3


def build(fused: bool) -> nn.Module:
    import fused_transformer as ft

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
    return ft.fuse(model) if fused else model


def wrap(model: nn.Module, strategy: str) -> nn.Module:
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)


def full_parameters(model: nn.Module) -> dict:
    """Every parameter gathered whole (FSDP2 shards them as DTensors), by name."""
    out = {}
    for name, p in model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("module.", "")] = p.detach().clone()
    return out


def worker(rank: int, world: int, strategy: str, out_dir: str) -> None:
    # A file rendezvous: no port to race for with other tests.
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}", rank=rank,
                            world_size=world)
    try:
        torch.set_num_threads(1)
        results = {}
        for fused in (False, True):
            model = wrap(build(fused), strategy)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            data = torch.Generator().manual_seed(100 + rank)
            for _ in range(STEPS):
                x = torch.randn(2, 6, D_MODEL, generator=data)
                padding = torch.arange(6)[None, :] >= torch.tensor([6, 4])[:, None]
                loss = model(x, src_key_padding_mask=padding)[~padding].square().mean()  # real tokens only
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            results["fused" if fused else "torch"] = full_parameters(model)
            # DDP's reducer (and its threads) must go while the process group still exists: destroyed at exit,
            # after the group, it aborted the process now and then ("terminate called without an active
            # exception").
            del model, optimizer
            gc.collect()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # neither rank tears its sockets down while the other still talks
    finally:
        dist.destroy_process_group()
