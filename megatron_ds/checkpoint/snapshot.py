"""--async-save's copy of a checkpoint's state, taken while training waits and written by another process.

DeepSpeed hands its checkpoint engine one state dict per file (module, optimizer, layer files); their
tensors are the training's own (parameters, Adam moments, fp32 masters), which the next step changes in
place. ``Snapshot.add`` pickles each state dict at once, in the training process, with every tensor
replaced by a reference to a copy of its storage in one memory file (``memfd``: anonymous, freed when
the last process holding it ends, so a kill -9 leaks nothing). Everything else in the state dict (the
LR scheduler's numbers, RNG states, DeepSpeed's config) is copied by the pickling itself. Storages are
copied whole, once each: tensors that share one (views, tied weights) share the copy, so the writer's
``torch.save`` writes the same storages and aliasing as a synchronous save (files of equal contents).

The writer (``background.py``) maps the same memory file and rebuilds the state dicts (``restore``)
without copying the tensors' bytes again.
"""
from __future__ import annotations

import io
import mmap
import os
import pickle
import tempfile

import torch

_PAGE = mmap.ALLOCATIONGRANULARITY
_ALIGN = 64  # each storage copy starts 64-byte aligned (any dtype's alignment, a cache line)


def _plain(obj) -> bool:
    """A dense tensor that a storage copy and a view of it reproduce (anything else pickles as torch pickles it)."""
    return (type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided
            and obj.device.type != "meta" and not obj.is_conj() and not obj.is_neg())


class _Pickler(pickle.Pickler):
    """Pickles tensors as (storage number, dtype, size, stride, offset, requires_grad, is Parameter);
    the storages are listed in ``sources`` for the copy."""

    def __init__(self, buffer, sources: list, index: dict):
        super().__init__(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.sources, self.index = sources, index

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor) or not _plain(obj):
            return None
        storage = obj.untyped_storage()
        key = (str(storage.device), storage.data_ptr(), storage.nbytes())
        if key not in self.index:
            self.index[key] = len(self.sources)
            self.sources.append(storage)
        return ("storage_view", self.index[key], obj.dtype, tuple(obj.size()), tuple(obj.stride()),
                obj.storage_offset(), obj.requires_grad, isinstance(obj, torch.nn.Parameter))


def _memory_file() -> int:
    """An anonymous memory file: memfd where Linux has it, else an unlinked file in /dev/shm or the temp dir."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("megatron_ds-ckpt-snapshot", getattr(os, "MFD_CLOEXEC", 0))
    fd, name = tempfile.mkstemp(prefix="megatron_ds-ckpt-snapshot-",
                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.unlink(name)
    return fd


def _reserve(fd: int, start: int, size: int) -> None:
    """Grow the memory file by ``size`` bytes at ``start``, its memory taken now: too little memory is an
    OSError here (ENOMEM, ENOSPC), not a SIGBUS while the tensors are copied into it."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, start, size)
    else:
        os.ftruncate(fd, start + size)


class Snapshot:
    """The copied state of one rank's checkpoint files: ``files`` [(path, pickled state with storage
    references)], ``storages`` [(offset, bytes)] in the memory file ``fd`` of ``nbytes`` bytes."""

    def __init__(self):
        self.fd = _memory_file()
        self.nbytes = 0
        self.files: list[tuple[str, bytes]] = []
        self.storages: list[tuple[int, int]] = []

    def add(self, state, path: str) -> None:
        """Copy ``state`` (what torch.save would write to ``path``) now. Storages already copied for an
        earlier file of this snapshot are copied again: each file holds its own, as torch.save writes them."""
        sources: list = []
        buffer = io.BytesIO()
        _Pickler(buffer, sources, {}).dump(state)
        first = len(self.storages)
        start = -(-self.nbytes // _PAGE) * _PAGE  # a page boundary: this file's storages are mapped from here
        offset = start
        for storage in sources:
            self.storages.append((offset, storage.nbytes()))
            offset = -(-(offset + storage.nbytes()) // _ALIGN) * _ALIGN
        if offset > start:
            _reserve(self.fd, start, offset - start)
            region = mmap.mmap(self.fd, offset - start, offset=start)
            try:
                for storage, (at, size) in zip(sources, self.storages[first:]):
                    if size:
                        target = torch.frombuffer(region, dtype=torch.uint8, count=size, offset=at - start)
                        target.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
                        del target  # no view of the region may outlive it
            finally:
                region.close()
        self.nbytes = max(self.nbytes, offset)
        self.files.append((path, first.to_bytes(8, "little") + buffer.getvalue()))

    def close(self) -> None:
        os.close(self.fd)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storages: list):
        super().__init__(io.BytesIO(data))
        self.storages = storages
        self.seen = {}  # one tensor per view, as one tensor referenced twice (tied weights) was pickled

    def persistent_load(self, pid):
        if pid not in self.seen:
            self.seen[pid] = self._tensor(*pid[1:])
        return self.seen[pid]

    def _tensor(self, number, dtype, size, stride, offset, requires_grad, parameter):
        tensor = torch.empty(0, dtype=dtype).set_(self.storages[number], offset, size, stride)
        if parameter:
            return torch.nn.Parameter(tensor, requires_grad=requires_grad)
        return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def restore(files: list[tuple[str, bytes]], storages: list[tuple[int, int]], arena) -> list[tuple[str, object]]:
    """In the writer: [(path, state dict)] with tensors viewing ``arena`` (the memory file, mapped whole)."""
    views = [torch.frombuffer(arena, dtype=torch.uint8, count=size, offset=at).untyped_storage() if size
             else torch.UntypedStorage(0) for at, size in storages]
    out = []
    for path, data in files:
        first = int.from_bytes(data[:8], "little")
        out.append((path, _Unpickler(data[8:], views[first:]).load()))
    return out
