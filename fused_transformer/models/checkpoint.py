"""Checkpoints of ``train``: what they hold, and writing them so that a kill cannot destroy the last good one.

``atomic_write(path, write)`` writes any file that way: into a temporary file in the same folder, flushed and
fsync'ed, then renamed over ``path`` (``os.replace``, atomic within a file system) and the folder fsync'ed. At
every moment ``path`` holds either its previous complete content or the new complete content. A process killed
mid-write leaves its temporary file behind, hidden next to ``path`` as ``.<name>.<pid>.<random>.tmp`` (never
``*.pt``); the next write to the same ``path`` removes those of processes that are no longer running.

A checkpoint is a ``torch.save`` dict: ``model`` (state_dict) and ``model_config`` (its constructor arguments),
``optimizer``, ``scheduler``, ``step``, the random generators the loop draws from (``data_rng``: the task's
batches; ``torch_rng``: dropout; ``cuda_rng`` when the model is on a GPU) and ``run_config``, the settings that
decide the run (training config and task), against which a resumed run is checked.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Any, Callable, Dict, List, Mapping, Optional

import torch

from .seq2seq import Seq2SeqTransformer

__all__ = [
    "atomic_write", "CheckpointMismatch", "rng_states", "save_checkpoint", "read_checkpoint", "check_same_run",
    "load_checkpoint", "model_from_checkpoint",
]


# ------------------------------------------------------------------------------------------ atomic writes


def atomic_write(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Create or replace the file ``path`` with what ``write(f)`` writes into the binary file object ``f``, so
    that ``path`` is never seen half-written, even if the process is killed or the machine loses power.

    The file gets the permissions it had (or, when new, those ``open`` would give it). Any exception in
    ``write`` (``KeyboardInterrupt`` included) leaves ``path`` untouched and removes the temporary file.
    OSErrors about the folder (missing, not a folder, not writable) name ``path``.
    """
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    _remove_stale_temp_files(folder, name)
    try:
        fd, temp = tempfile.mkstemp(dir=folder, prefix=f".{name}.{os.getpid()}.", suffix=".tmp")
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write a file there ({exc.strerror})", path) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, _mode_for(path))
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_folder(folder)


def _mode_for(path: str) -> int:
    """The permissions ``path`` has, or for a new file 0o666 less the umask (mkstemp's would be 0o600)."""
    with contextlib.suppress(OSError):
        return os.stat(path).st_mode & 0o7777
    umask = os.umask(0o022)  # the only portable way to read it; a thread creating a file meanwhile gets 022
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_folder(folder: str) -> None:
    """Make the rename itself durable. Windows cannot open a folder, some file systems cannot fsync one: skip."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale_temp_files(folder: str, name: str) -> None:
    """Remove the temporary files of writes of ``name`` whose process is gone (killed mid-write)."""
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows
        return
    prefix = f".{name}."
    with contextlib.suppress(OSError):
        for entry in os.listdir(folder):
            # exactly ".<name>.<pid>.<random>.tmp": the name of another file may also start with ".<name>."
            parts = entry[len(prefix):].split(".") if entry.startswith(prefix) else []
            if len(parts) == 3 and parts[0].isdigit() and parts[2] == "tmp" and not _running(int(parts[0])):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, entry))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# ------------------------------------------------------------------------------------------ checkpoints


class CheckpointMismatch(ValueError):
    """A checkpoint saved by a different run (model or settings) than the one asked to resume from it."""


def rng_states(data_generator: torch.Generator, device: torch.device) -> Dict[str, torch.Tensor]:
    """The states of every random generator ``train`` draws from, as a checkpoint stores them."""
    states = {"data_rng": data_generator.get_state(), "torch_rng": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda_rng"] = torch.cuda.get_rng_state(device)
    return states


def save_checkpoint(
    path: str, model: Seq2SeqTransformer, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler, step: int, data_generator: torch.Generator,
    run_config: Optional[Mapping[str, Any]] = None, rng: Optional[Mapping[str, torch.Tensor]] = None,
) -> None:
    """Write everything ``train`` needs to resume, with ``atomic_write``: the model and its constructor
    arguments, optimizer, scheduler, ``step``, the random generators (``rng`` as ``rng_states`` gives them;
    default: their current states) and ``run_config`` (plain values; a resumed run must match it)."""
    if rng is None:
        rng = rng_states(data_generator, next(model.parameters()).device)
    state = {
        "model": model.state_dict(), "model_config": dict(model.config), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "step": step, **rng,
        "run_config": None if run_config is None else dict(run_config),
    }
    atomic_write(path, lambda f: torch.save(state, f))


def read_checkpoint(path: str) -> Dict[str, Any]:
    """The checkpoint at ``path`` as a dict (tensors on the CPU)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def check_same_run(state: Mapping[str, Any], model_config: Mapping[str, Any],
                   run_config: Optional[Mapping[str, Any]], path: str) -> None:
    """Raise ``CheckpointMismatch`` naming every difference unless the checkpoint ``state`` (read from ``path``)
    was saved by a model built with ``model_config`` and by a run with ``run_config`` (not compared when
    either side has none)."""
    saved_run = state.get("run_config")
    differences = _differences("model", state["model_config"], model_config)
    if saved_run is not None and run_config is not None:
        differences += _differences("run", saved_run, run_config)
    if differences:
        raise CheckpointMismatch(f"checkpoint {path} was saved by a different run: {'; '.join(differences)}")


def _differences(prefix: str, saved: Any, given: Any) -> List[str]:
    if isinstance(saved, Mapping) and isinstance(given, Mapping):
        return [d for key in sorted(set(saved) | set(given), key=str)
                for d in _differences(f"{prefix}.{key}", saved.get(key), given.get(key))]
    return [] if saved == given else [f"{prefix} is {given!r}, the checkpoint has {saved!r}"]


def load_checkpoint(
    path: str, model: Seq2SeqTransformer, optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None,
    data_generator: Optional[torch.Generator] = None, run_config: Optional[Mapping[str, Any]] = None,
) -> int:
    """Load a checkpoint into ``model`` (fused or torch.nn build, strictly) and whichever of the training
    states are given (``data_generator`` also restores torch's own generators); returns the step it was
    saved at. With ``run_config`` (resuming), first ``check_same_run``: nothing is loaded from another run."""
    state = read_checkpoint(path)
    if run_config is not None:
        check_same_run(state, model.config, run_config, path)
    model.load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if data_generator is not None:
        data_generator.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        device = next(model.parameters()).device
        if device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
    return int(state["step"])


def model_from_checkpoint(path: str, fused: bool = True) -> Seq2SeqTransformer:
    """Rebuild the model saved in ``path``: on the fused modules, or with ``fused=False`` on torch.nn."""
    state = read_checkpoint(path)
    model = Seq2SeqTransformer(**state["model_config"], fused=fused)
    model.load_state_dict(state["model"], strict=True)
    return model
