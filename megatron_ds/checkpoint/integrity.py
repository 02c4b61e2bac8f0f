"""Checkpoint integrity: a manifest per checkpoint, verified on load, with fallback and pruning.

When every rank has written its files, ``write_manifest`` records each file of ``global_stepN/``
with its size and CRC-32 in ``megatron_ds_manifest.json``; the trackers are written after it, so a
checkpoint with a valid manifest is complete by construction.

Why full CRC-32 and not sampled blocks: a 13B run's checkpoint is ~180 GB (2-byte weights plus
12 bytes/parameter of fp32 master weights and Adam moments). zlib.crc32 runs at 1-4 GB/s per
core, and the files are split over all ranks (round-robin by size), so with the 128 ranks of a
TP 4 x PP 8 x DP 4 job each rank hashes ~1.4 GB: about a second, mostly from the page cache just
written. Full coverage also catches a bit flip or a zeroed block in the middle of a tensor, which
sampling would miss. Loading hashes the same shares again before any tensor is read.

A checkpoint is complete when its manifest, written last (atomically, before the trackers), says
so; nothing else counts. A ``global_stepN`` without one is an interrupted save (a job killed while
saving): never loaded, never taken for a newer complete checkpoint, moved aside by the next run.
Checkpoints written before manifests existed (the config file rank 0 wrote after all ranks' files,
no manifest, and no file only a manifest-era save writes: ``format.COMPLETENESS`` in that config,
a half-written manifest) load unverified.

``choose_checkpoint`` picks what ``--load`` loads: the tracker's step if it verifies, else the
newest older complete one (saying why), or -- without a usable tracker -- the newest complete
``global_step*``; ``--ckpt-step N`` demands exactly N. A complete checkpoint newer than the tracker
whose manifest was written after the tracker is a save the job finished but was killed before
updating the tracker: it is loaded first. (A tracker edited back by hand is newer than every
manifest: that rollback is kept, and ``protect_newer`` refuses to overwrite the newer ones.) When
nothing complete ever existed -- no tracker, only interrupted saves, as after a kill during the first
save -- the run starts from scratch.

All functions that take no ``rank0`` are collective: every rank calls them and gets the same answer.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib

import torch.distributed as dist

from megatron_ds.checkpoint.format import (COMPLETENESS, MANIFEST, META, TRACKER, atomic_write, list_steps, read_meta,
                                           read_tracker, step_dir)
from megatron_ds.errors import ConfigError

_CHUNK = 16 << 20
DELETING = ".deleting"
# what protect_newer names an interrupted save it moves aside (_free_name numbers repeats)
_INTERRUPTED_ASIDE = re.compile(r"^global_step\d+\.incomplete\d*$")
# Checkpoints found damaged by choose_checkpoint in this process (path -> problem), so that
# protect_newer moves them aside instead of hashing them again or calling them complete.
_found_damaged: dict[str, str] = {}


def crc32_file(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast(obj):
    """rank 0's obj on every rank (directory listings may be cached differently per node)."""
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    if _rank_world()[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _share(sizes: dict[str, int]) -> list[str]:
    """This rank's files: largest first, dealt round-robin, so the bytes hashed per rank even out."""
    rank, world = _rank_world()
    order = sorted(sizes, key=lambda n: (-sizes[n], n))
    return order[rank::world]


def _list_files(ckpt_dir: str) -> dict[str, int]:
    sizes = {}
    for root, _, files in os.walk(ckpt_dir):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, ckpt_dir)
            if rel not in (MANIFEST, META) and ".tmp." not in name:
                sizes[rel] = os.path.getsize(path)
    return sizes


def write_manifest(ckpt_dir: str, iteration: int, known: dict[str, tuple[int, int]] | None = None) -> None:
    """Collective, after every rank's files are written and before the trackers. ``known``: (size,
    CRC-32) of files by name, taken by whoever wrote them (--async-save's writers hash as they write);
    a listed file of another size, and every file not in it, is hashed here (rank 0's ``known`` counts)."""
    rank, _ = _rank_world()
    known = known or {}
    sizes = _broadcast(_list_files(ckpt_dir) if rank == 0 else None)
    todo = {n: size for n, size in sizes.items() if known.get(n, (None,))[0] != size}
    crcs = {n: crc for n, (_, crc) in known.items() if n in sizes and n not in todo}
    for part in _gather({n: crc32_file(os.path.join(ckpt_dir, n)) for n in _share(todo)}):
        crcs.update(part)
    if rank == 0:
        files = {n: {"size": sizes[n], "crc32": f"{crcs[n]:08x}"} for n in sorted(sizes)}
        meta = os.path.join(ckpt_dir, META)
        if os.path.isfile(meta):
            size = os.path.getsize(meta)
            crc = known[META][1] if known.get(META, (None,))[0] == size else crc32_file(meta)
            files[META] = {"size": size, "crc32": f"{crc:08x}"}
        atomic_write(os.path.join(ckpt_dir, MANIFEST), json.dumps(
            {"format": 1, "iteration": iteration, "checksum": "crc32", "files": files}, indent=1, sort_keys=True))


def _from_before_manifests(ckpt_dir: str) -> bool:
    """No manifest, but the config a save then wrote last, and nothing a manifest-era save writes."""
    if not os.path.isfile(os.path.join(ckpt_dir, META)):
        return False
    if any(name.startswith(f"{MANIFEST}.tmp.") for name in os.listdir(ckpt_dir)):
        return False  # a manifest half-written when the job was killed
    try:
        meta = read_meta(ckpt_dir)
    except (ValueError, OSError):
        return False
    return not (isinstance(meta, dict) and meta.get(COMPLETENESS[0]) == COMPLETENESS[1])


def interrupted(ckpt_dir: str) -> bool:
    """Not collective: a save that never wrote its manifest (a job killed while saving)."""
    return (os.path.isdir(ckpt_dir) and not os.path.isfile(os.path.join(ckpt_dir, MANIFEST))
            and not _from_before_manifests(ckpt_dir))


def _read_manifest(ckpt_dir: str):
    """(manifest dict | None, problem | None). None, None: a checkpoint from before manifests."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isdir(ckpt_dir):
        return None, f"{ckpt_dir} does not exist"
    if not os.path.isfile(path):
        if _from_before_manifests(ckpt_dir):
            return None, None
        return None, f"{ckpt_dir} is incomplete: its save was interrupted before {MANIFEST} was written"
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
        manifest["files"].items()
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        return None, f"{path} is unreadable ({type(exc).__name__})"
    return manifest, None


def _check_file(ckpt_dir: str, name: str, entry: dict, with_crc: bool) -> str | None:
    path = os.path.join(ckpt_dir, name)
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    if size != entry["size"]:
        return f"{path} has {size} bytes, the manifest says {entry['size']} (truncated or rewritten)"
    if with_crc and f"{crc32_file(path):08x}" != entry["crc32"]:
        return f"{path} fails its CRC-32 check (contents changed since the save: damaged or zeroed)"
    return None


def verify(ckpt_dir: str) -> str | None:
    """Collective. None if the checkpoint is complete and intact, else one line naming the file."""
    rank, _ = _rank_world()
    manifest, problem = _broadcast(_read_manifest(ckpt_dir) if rank == 0 else None)
    if problem or manifest is None:
        return problem
    files = manifest["files"]
    mine = _share({n: e["size"] for n, e in files.items()})
    problems = [p for p in (_check_file(ckpt_dir, n, files[n], with_crc=True) for n in mine) if p]
    found = sorted(p for part in _gather(problems) for p in part)
    return found[0] if found else None


def quick_status(ckpt_dir: str) -> str | None:
    """Not collective: sizes only (no hashing). None = looks complete."""
    manifest, problem = _read_manifest(ckpt_dir)
    if problem or manifest is None:
        return problem
    for name, entry in manifest["files"].items():
        if (p := _check_file(ckpt_dir, name, entry, with_crc=False)):
            return p
    return None


def _saved_after_tracker(load_dir: str, step: int) -> bool:
    """The step's manifest was written after the tracker: its save completed, the tracker update did not."""
    manifest = os.path.join(step_dir(load_dir, step), MANIFEST)
    try:
        return os.stat(manifest).st_mtime >= os.stat(os.path.join(load_dir, TRACKER)).st_mtime
    except OSError:
        return False


def _candidates(load_dir: str) -> tuple[list[int], list[int], list[str], bool]:
    """rank 0: (iterations to try in order, those that are interrupted saves, notes explaining the
    order, whether a tracker file exists)."""
    tracked, problem = read_tracker(load_dir)
    steps = list_steps(load_dir)
    cut = [s for s in steps if interrupted(step_dir(load_dir, s))]
    notes = [problem] if problem else []
    has_tracker = os.path.isfile(os.path.join(load_dir, TRACKER))
    if tracked is None:
        if steps:
            notes.append(f"no usable {TRACKER} in {load_dir}: using the newest complete global_step*")
        return steps, cut, notes, has_tracker
    finished = [s for s in steps if s > tracked and s not in cut and _saved_after_tracker(load_dir, s)]
    if finished:
        notes.append(f"global_step{finished[0]} was saved completely after {TRACKER} ({tracked}) was last "
                     f"written (the job was killed before updating it): trying it first")
    return finished + [tracked] + [s for s in steps if s < tracked], cut, notes, has_tracker


def choose_checkpoint(load_dir: str, *, exact_step: int | None = None, log=print) -> int | None:
    """Collective: the iteration to load from load_dir, None when it holds no checkpoint."""
    rank, _ = _rank_world()
    if exact_step is not None:
        problem = verify(step_dir(load_dir, exact_step))
        if problem:
            raise ConfigError(f"--ckpt-step {exact_step}: {problem}")
        return exact_step
    order, cut, notes, has_tracker = _broadcast(_candidates(load_dir) if rank == 0 else None)
    for note in notes:
        log(f"WARNING: {note}")
    damaged = []
    for step in order:
        path = step_dir(load_dir, step)
        if step in cut:
            log(f"WARNING: skipping {path}: an interrupted save (no {MANIFEST})")
            continue
        problem = verify(path)
        if problem is None:
            if damaged:
                log(f"WARNING: falling back to the newest complete checkpoint, iteration {step} (pass "
                    f"--ckpt-step {damaged[0]} to demand the damaged one)")
            return step
        log(f"WARNING: checkpoint damaged: {problem}")
        _found_damaged[os.path.realpath(path)] = problem
        damaged.append(step)
    if damaged or (has_tracker and order):  # something complete existed: starting over would lose it
        raise ConfigError(f"no complete checkpoint in --load {load_dir} (tried iterations "
                          f"{', '.join(map(str, order))}; see the warnings above)")
    if cut:  # nothing complete ever existed (a kill during the first save): nothing is lost by starting over
        log(f"WARNING: --load {load_dir} holds only interrupted saves, no complete checkpoint; starting from "
            f"scratch")
    return None


def protect_newer(save_dir: str, start_iteration: int, *, log=print) -> None:
    """Collective, before training: a complete checkpoint in --save newer than where this run starts
    would be overwritten by it, so that is an error; damaged newer ones are moved aside."""
    rank, _ = _rank_world()
    error = None
    if rank == 0:
        for step in list_steps(save_dir):
            if step <= start_iteration:
                continue
            path = step_dir(save_dir, step)
            problem = _found_damaged.get(os.path.realpath(path)) or quick_status(path)
            if problem is None:
                error = (f"--save {save_dir} already holds a complete checkpoint at iteration {step}, "
                         f"newer than this run's start ({start_iteration}), and would be overwritten: ")
                error += (f"pass --load {save_dir} to continue from it, or use another --save directory"
                          if start_iteration == 0 else
                          f"to go back to iteration {start_iteration} on purpose, move {path} (and any newer) "
                          f"elsewhere first, or use another --save directory")
                break
            kind = "interrupted save" if interrupted(path) else "damaged checkpoint"
            aside = _free_name(f"{path}.{'incomplete' if kind == 'interrupted save' else 'damaged'}")
            os.rename(path, aside)
            log(f"WARNING: moved the {kind} {path} aside to {aside} ({problem})")
    error = _broadcast(error)
    if error:
        raise ConfigError(error)


def _free_name(base: str) -> str:
    name, n = base, 1
    while os.path.exists(name):
        n += 1
        name = f"{base}{n}"
    return name


def prune(save_dir: str, newest: int, keep_last: int | None, *, log=print) -> None:
    """rank 0, after checkpoint `newest` is complete: delete the interrupted saves moved aside earlier
    (``*.incomplete``: nothing loads from them, and a job killed inside saves again and again would
    otherwise fill the disk with them), and with `keep_last` the complete checkpoints older than the
    newest `keep_last` (damaged ones are left for a person to look at). Each is renamed first, so a
    kill during the deletion leaves a ``*.deleting`` folder (finished next time), never a
    half-deleted checkpoint that looks damaged."""
    for name in sorted(os.listdir(save_dir)):
        if name.endswith(DELETING):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        elif _INTERRUPTED_ASIDE.match(name):
            discard(os.path.join(save_dir, name))
            log(f"deleted the interrupted save {os.path.join(save_dir, name)} (checkpoint {newest} is complete)")
    if not keep_last:
        return
    complete = [s for s in list_steps(save_dir) if s <= newest
                and quick_status(step_dir(save_dir, s)) is None]
    for step in complete[keep_last:]:
        path = step_dir(save_dir, step)
        discard(path)
        log(f"deleted checkpoint {path} (--keep-last {keep_last})")


def discard(path: str) -> None:
    """Not collective: delete a checkpoint folder, renamed first so that a kill midway leaves a
    ``*.deleting`` folder (finished by the next prune), never a half-deleted checkpoint."""
    os.rename(path, path + DELETING)
    shutil.rmtree(path + DELETING, ignore_errors=True)
