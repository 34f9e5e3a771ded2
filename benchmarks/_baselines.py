"""The other savers and loaders: torch.save/torch.load, safetensors and torch.distributed.checkpoint (DCP).

Every saver is made durable the way aiockpt is: each file it wrote and the directories naming them are
fsynced before it returns. Loaders that fill the preallocated template copy into it; the others return
fresh tensors, as ``aiockpt.read`` does.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import safetensors.torch
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save_fn

from benchmarks._fs import fsync_tree

State = dict[str, torch.Tensor]

TORCH_FILE = "state.pt"
SAFETENSORS_FILE = "model.safetensors"


def torch_save(state: State, path: Path) -> None:
    """``torch.save`` into ``path/state.pt``, then fsync the file and directories."""
    path.mkdir()
    with open(path / TORCH_FILE, "wb") as f:
        torch.save(state, f)
    fsync_tree(path)


def torch_load(path: Path) -> State:
    """Plain ``torch.load`` (weights_only): reads everything into fresh tensors."""
    out: State = torch.load(path / TORCH_FILE, weights_only=True)
    return out


def torch_load_mmap_into(template: State, path: Path) -> None:
    """``torch.load(mmap=True)`` then ``copy_`` every tensor into ``template``, as ``load_state_dict`` would.

    The copy is what actually reads the file: an mmap'd load alone only maps it.
    """
    loaded: State = torch.load(path / TORCH_FILE, mmap=True, weights_only=True)
    for key, t in template.items():
        t.copy_(loaded[key])


def safetensors_save(state: State, path: Path) -> None:
    """``safetensors.torch.save_file`` into ``path/model.safetensors``, then fsync file and directories."""
    path.mkdir()
    safetensors.torch.save_file(state, str(path / SAFETENSORS_FILE))
    fsync_tree(path)


def safetensors_load(path: Path) -> State:
    """``safetensors.torch.load_file``: fresh tensors."""
    out: State = safetensors.torch.load_file(str(path / SAFETENSORS_FILE))
    return out


def dcp_save(state: State, path: Path, threads: int) -> None:
    """Single-process ``dcp.save`` with ``FileSystemWriter(thread_count=threads)`` (it fsyncs its files).

    Without an initialized process group DCP saves as a single process (it warns; silenced here). The
    directory tree is fsynced afterwards, which DCP itself does not do.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_save_fn(state, storage_writer=FileSystemWriter(str(path), sync_files=True, thread_count=threads))
    fsync_tree(path)


def dcp_load_into(template: State, path: Path) -> None:
    """Single-process ``dcp.load`` into ``template`` in place, with the default ``FileSystemReader``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(template, storage_reader=FileSystemReader(str(path)))
