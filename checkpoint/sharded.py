"""The training state on disk: one checkpoint folder per save, published by a small pointer file
(checkpoint/pointer.py), nothing in it ever unpickled.

A checkpoint folder holds:
- a torch.distributed.checkpoint (DCP) checkpoint that every rank writes at once (`.metadata`,
  `__<rank>_0.distcp`): the class centres and their optimizer state as shards of the global
  (num_classes, D) matrices, each rank writing and reading only its own rows (a run on another world
  size reads its rows from whichever files hold them), and the backbone's optimizer state. No process
  ever holds all centres, on saving or on loading;
- `backbone.pth` and `model.json`: rank 0's backbone (the one exported) and what it is;
- `state.json`: the rest, as numbers: optimizer settings, schedule, grad scaler, progress, config,
  and each rank's loader position and random streams;
- `manifest.json`, written last: every other file's size and crc32c (checkpoint/manifest.py).

A save writes `.tmp-checkpoint-<step>/` on every rank, checks and fsyncs it, renames it to its final
name, switches `checkpoint.json` to it, links its backbone.pth and model.json into the run folder (the
files tools read), and only then removes older folders: a crash or a full disk at any moment leaves
the previous checkpoint published and whole. A load verifies every checksum before reading (each
rank its share of the shards) and reads DCP's index through checkpoint/safe_dcp.py.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from backbones.trained import BACKBONE_NAME, MODEL_INFO_NAME, model_info
from checkpoint.manifest import (
    MANIFEST_NAME,
    IntegrityError,
    checked_json,
    describe_files,
    read_checked_json,
    verify_file,
)
from checkpoint.pointer import (
    FOLDER_PREFIX,
    TMP_FOLDER_PREFIX,
    complete_folders,
    folder_step,
    free_folder_name,
    read_pointer,
    write_pointer,
)
from checkpoint.restored import Restored, check_architecture
from checkpoint.safe_dcp import SHARD_FILE, MetadataError, SafeReader, TensorsOnlyPlanner, read_metadata
from checkpoint.state_file import STATE_NAME, check_state
from training.components import Component
from training.fields import StateFieldError
from training.progress import StepCounter, as_counter
from training.state import TrainingState, registry, restore_components
from utils.atomic import atomic_save, fsync_dir, os_error_behind, write_bytes
from utils.compat import DCP_ALONE_WARNING, SHARDED_TENSOR_WARNING, dcp_group, row_block
from utils.distributed import gather_objects, is_initialized, is_main, raise_first, rank, run_on_rank0, world
from utils.errors import CheckpointError
from utils.torch_files import load_torch_file

METADATA_NAME = ".metadata"
# state.json's run entries that describe the run rather than hold its state: what the weights are shaped for
# (a resume checks it), the config (a resume compares it) and the number of processes (whose per-rank state a
# resume can take as it is)
RUN_DESCRIPTION = ("model", "config", "world_size")
EXPORTED = (BACKBONE_NAME, MODEL_INFO_NAME)  # linked into the run folder once published
_DAMAGED = "it is damaged or incomplete"

log = logging.getLogger(__name__)


# --- saving ---------------------------------------------------------------------------------------

@dataclass
class Staged:
    """One save's content, taken at a step boundary: what the writing needs, nothing that a later step
    changes (with `host_copy`, the tensors are copies the training no longer touches)."""

    step: int
    tensors: dict                  # for DCP: every component's tensor keys (centre rows as blocks)
    rank_state: dict               # this rank's own components (loader position, random streams)
    architecture: dict
    backbone: dict | None = None   # rank 0: the exported backbone's state_dict, CPU tensors
    run: dict = field(default_factory=dict)  # rank 0: everything else, as JSON


def stage_state(state: TrainingState, progress: StepCounter | Mapping, loader, architecture: Mapping, config: Mapping,
                host_copy: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> Staged:
    """The content of a save of every component of the run now: `state`'s, the step counter `progress` (or its
    saved form) and `loader`'s position (a Stateful). `host_copy(name, tensor)` copies each tensor to host
    memory (for a save written while training goes on); without it the save refers to the live tensors."""
    copy = host_copy or (lambda _, tensor: tensor.detach())
    counter = as_counter(progress)
    # Folders are named, and checkpoint.json counts, by the shown step (the log's): it never runs backwards,
    # where the schedule's step restarts lower on a resume with more steps per epoch.
    staged = Staged(step=counter.shown_step, architecture=dict(architecture), tensors={}, rank_state={})
    run: dict = {}
    for component in registry(state, counter, loader):
        for key, value in component.state_dict().items():
            if key in component.file_keys:
                if is_main():  # rank 0's file (the backbone's BatchNorm statistics are each rank's own)
                    staged.backbone = {name: copy(f"{key}.{name}", tensor).cpu() for name, tensor in value.items()}
            elif key in component.tensor_keys:
                staged.tensors[key] = _staged_tensors(component, (key,), value, copy)
            elif component.per_rank:
                staged.rank_state[key] = value
            else:
                run[key] = value
    if is_main():
        staged.run = {"model": dict(architecture), "config": dict(config), "world_size": world(), **run}
    return staged


def _staged_tensors(component: Component, path: tuple[str, ...], value, copy: Callable):
    """A component's tensors under `path`, each copied and then written as the component says (shard)."""
    if torch.is_tensor(value):
        return component.shard(path, copy(".".join(path), value))
    return {name: _staged_tensors(component, (*path, str(name)), item, copy) for name, item in value.items()}


def save_state(output: str | Path, state: TrainingState, progress: StepCounter | Mapping, loader, architecture: Mapping,
               config: Mapping) -> Path:
    """Write `state` and publish it now (write_state of stage_state). Collective; returns the folder."""
    return write_state(output, stage_state(state, progress, loader, architecture, config))


def write_state(output: str | Path, staged: Staged, group=None) -> Path:
    """Write `staged` as a checkpoint folder of `output` and publish it. Collective over `group` (every
    rank calls it, possibly in a background thread); a failure on any rank raises the same
    CheckpointError on every rank, the previous checkpoint still published. Returns the folder."""
    output = Path(output)
    tmp = output / f"{TMP_FOLDER_PREFIX}{staged.step:09d}"
    target = output / f"{FOLDER_PREFIX}{staged.step:09d}"
    run_on_rank0(lambda: _fresh(tmp, target), group=group)
    try:
        with _quiet_when_alone():
            dcp.save(staged.tensors, storage_writer=_writer(tmp, staged.tensors), **dcp_group(group))
    except CheckpointException as error:  # raised on every rank, whichever failed
        run_on_rank0(lambda: shutil.rmtree(tmp, ignore_errors=True), group=group)
        raise _failure("could not write", target, error, "the previous checkpoint is untouched: free disk space or "
                       "choose another output folder") from None
    shards = gather_objects(_own_shards(tmp), group=group)
    ranks = gather_objects(staged.rank_state, group=group)
    return run_on_rank0(lambda: _complete_and_publish(output, tmp, target, staged, shards, ranks), group=group)


def _writer(tmp: Path, tensors: Mapping) -> FileSystemWriter:
    """DCP's writer into `tmp`. Its copy-ahead (GPU tensors copied to the host ahead of their write) runs on
    the writing thread's current CUDA stream, creating a CUDA context when there is none: it is for live
    GPU tensors only, never for host copies (an async save's)."""
    if any(leaf.device.type != "cpu" for leaf in _tensor_leaves(tensors)):
        return FileSystemWriter(tmp, sync_files=True)
    return FileSystemWriter(tmp, sync_files=True, per_thread_copy_ahead=0)


def _tensor_leaves(tree: Mapping) -> Iterator[torch.Tensor]:
    for value in tree.values():
        if torch.is_tensor(value):
            yield value
        elif isinstance(value, Mapping):
            yield from _tensor_leaves(value)


def _fresh(tmp: Path, target: Path) -> None:
    """Rank 0, before a save: an empty temporary folder (a killed save's leftovers go)."""
    for leftover in tmp.parent.glob(f"{TMP_FOLDER_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as error:
        raise _write_error(target, error) from None


def _own_shards(tmp: Path) -> dict | str:
    """This rank's DCP files with their sizes and checksums (read back from the page cache), or why not."""
    names = sorted(path.name for path in tmp.glob(f"__{rank()}_*.distcp"))
    try:
        return describe_files(tmp, names)
    except OSError as error:
        return f"rank {rank()}: {error.strerror or error}"


def _complete_and_publish(output: Path, tmp: Path, target: Path, staged: Staged, shards: list, ranks: list) -> Path:
    """Rank 0, once every rank's files are written and fsynced: the rest of the folder, its manifest,
    the rename, the pointer switch, the exported backbone, then the removal of older folders."""
    failed = next((shard for shard in shards if isinstance(shard, str)), None)
    if failed is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not read back checkpoint {target} ({failed}); the previous checkpoint is "
                              "untouched: check the disk, or choose another output folder")
    try:
        atomic_save(checked_json({"run": staged.run, "ranks": ranks}), tmp / STATE_NAME, write=write_bytes)
        atomic_save(json.dumps(model_info(staged.architecture, staged.run["progress"].get("verification")),
                               indent=2).encode(), tmp / MODEL_INFO_NAME, write=write_bytes)
        atomic_save(staged.backbone, tmp / BACKBONE_NAME)
        files = describe_files(tmp, [METADATA_NAME, STATE_NAME, *EXPORTED])
        for per_rank in shards:
            files.update(per_rank)
        atomic_save(checked_json({"files": files}), tmp / MANIFEST_NAME, write=write_bytes)
        folder = output / free_folder_name(output, staged.step)
        tmp.rename(folder)
        fsync_dir(output)
    except (OSError, CheckpointError) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(target, error) from None
    write_pointer(output, folder.name, staged.step, staged.run["world_size"], staged.architecture)
    _export(folder, output)
    older = [path for path in output.glob(f"{FOLDER_PREFIX}*") if folder_step(path.name) is not None]
    for old in [*older, *output.glob(f"{TMP_FOLDER_PREFIX}*")]:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _export(folder: Path, output: Path) -> None:
    """The published backbone.pth and model.json as the run folder's own (hard links: no second copy on
    disk; a copy where the filesystem has none), each replaced atomically."""
    for name in EXPORTED:
        tmp = output / f".tmp-{name}.link"
        tmp.unlink(missing_ok=True)
        try:
            try:
                os.link(folder / name, tmp)
            except OSError:
                shutil.copyfile(folder / name, tmp)
            os.replace(tmp, output / name)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"checkpoint {folder} is saved and published, but {output / name} could not be "
                                  f"updated from it ({error.strerror or error}); free disk space: the next save "
                                  "updates it, and --resume works as it is") from None
    fsync_dir(output)


# --- loading --------------------------------------------------------------------------------------

@dataclass
class Verified:
    """A checkpoint folder whose small files were checked on rank 0 (the shards are checked by every rank)."""

    folder: Path
    shards: dict[str, dict[str, int]]   # shard file -> size and crc32c from the manifest
    content: dict                       # state.json
    tensors: dict[str, tuple]           # {fqn: (shape, dtype)} of every tensor DCP holds


def checkpoint_folder(source: Path) -> Path:
    """The folder a resume source names: checkpoint.json's published folder, or a checkpoint folder itself."""
    if source.is_dir():
        return source
    return source.parent / read_pointer(source)["directory"]


def verify_folder(folder: Path) -> Verified:
    """Rank 0's checks of a checkpoint folder before anything is loaded: the manifest, every small file's
    checksum, DCP's index read safely, state.json. CheckpointError naming the file and an alternative."""
    try:
        listed = read_checked_json(folder / MANIFEST_NAME).get("files")
        if not isinstance(listed, dict) or not {METADATA_NAME, STATE_NAME, *EXPORTED} <= set(listed):
            raise IntegrityError(f"{folder / MANIFEST_NAME} does not list the files of a checkpoint")
        shards = {name: entry for name, entry in listed.items() if SHARD_FILE.fullmatch(name)}
        for name in (METADATA_NAME, STATE_NAME, *EXPORTED):
            verify_file(folder, name, listed[name])
        metadata = read_metadata(folder / METADATA_NAME)
        content = read_checked_json(folder / STATE_NAME)
        check_state(content)
    except StateFieldError as error:
        raise damaged(folder, f"{folder / STATE_NAME}: {error}") from None
    except FileNotFoundError as error:
        raise damaged(folder, f"{error.filename} is missing") from None
    except (OSError, IntegrityError, MetadataError) as error:
        where = f"{folder / METADATA_NAME}: " if isinstance(error, MetadataError) else ""
        raise damaged(folder, where + str(error)) from None
    stored = {item.relative_path for item in metadata.storage_data.values()}
    if not stored <= set(shards):
        raise damaged(folder, f"{folder / METADATA_NAME} names {sorted(stored - set(shards))[0]}, which the manifest "
                              "does not list")
    tensors = {fqn: (tuple(md.size), md.properties.dtype) for fqn, md in metadata.state_dict_metadata.items()}
    return Verified(folder=folder, shards=shards, content=content, tensors=tensors)


def verify_shards(verified: Verified) -> None:
    """Every rank checks its share of the shard files; the first mismatch stops every rank. Collective."""
    error = None
    for i, (name, entry) in enumerate(sorted(verified.shards.items())):
        if i % world() == rank():
            try:
                verify_file(verified.folder, name, entry)
            except (OSError, IntegrityError) as failure:
                error = damaged(verified.folder, str(failure))
                break
    raise_first(error)


def damaged(folder: Path, reason: str) -> CheckpointError:
    """The one line for a checkpoint folder that fails a check: what, and the last good alternative."""
    alternatives = [other for other in complete_folders(folder.parent) if other != folder]
    if alternatives:
        fix = (f"resume from the last good one with --set resume={alternatives[0]} (checked in the same way), or "
               "start a new run")
    else:
        fix = "no other checkpoint is left in the run folder: copy the folder again from a backup, or start a new run"
    return CheckpointError(f"checkpoint {folder} is damaged ({reason}); {fix}")


def restore_state(source: Path, architecture: Mapping, state: TrainingState) -> Restored:
    """Load the checkpoint `source` names (checkpoint.json, or a checkpoint folder) into `state`, each rank
    its own centre rows, after checking every file. Collective: a checkpoint that fails any check on any
    rank stops every rank with the same CheckpointError."""
    verified = run_on_rank0(lambda: _checked(source, architecture))
    verify_shards(verified)
    template: dict = {}
    for component in state.components:
        template.update(component.template(verified.tensors))
    try:
        with _quiet_when_alone():
            dcp.load(template, storage_reader=SafeReader(verified.folder), planner=TensorsOnlyPlanner(),
                     **dcp_group(None))
    except CheckpointException as error:
        raise _failure("cannot read", verified.folder, error, f"{_DAMAGED}: resume from another run folder or "
                       "start a new run") from None
    try:
        return _apply(verified, template, state)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as error:
        # every file matched its checksum, so these were written so, not damaged since
        reason = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        raise CheckpointError(f"checkpoint {verified.folder} does not hold what pairface writes ({reason}); resume "
                              "from a checkpoint pairface wrote, or start a new run") from None


def _checked(source: Path, architecture: Mapping) -> Verified:
    folder = checkpoint_folder(source)
    if not folder.is_dir():
        raise damaged(folder, "the folder is missing")
    verified = verify_folder(folder)
    check_architecture(verified.content.get("run", {}).get("model", {}), architecture,
                       source if source.is_file() else folder)
    return verified


def _apply(verified: Verified, loaded: dict, state: TrainingState) -> Restored:
    """Put every component in place, the backbone first: each gets its keys of state.json's run record, of
    backbone.pth and of the tensors DCP loaded for it. The step counter's and each process's own entries go back
    as Restored: the checkpointer decides how they apply (a renumbered step, rank 0's loader position)."""
    run, ranks = verified.content["run"], verified.content["ranks"]
    backbone = load_torch_file(verified.folder / BACKBONE_NAME,
                               lambda reason: damaged(verified.folder, f"{BACKBONE_NAME}: {reason}"))
    tensor_keys = {key for component in state.components for key in component.tensor_keys}
    restore_components(state, {**{key: value for key, value in run.items() if key not in tensor_keys}, **loaded,
                               "backbone": backbone})  # training.components.Backbone's file
    held = {fqn.split(".", 1)[0] for fqn in verified.tensors} | set(run) - set(RUN_DESCRIPTION)
    owned = {key for component in [*state.components, StepCounter] for key in component.keys}
    unused = sorted(held - owned)
    if unused and is_main():
        log.warning("checkpoint %s also holds %s, which no part of this run's training state loads (its config "
                    "leaves that part out, e.g. ema_decay=0): not restored", verified.folder, ", ".join(unused))
    same_world = run["world_size"] == world() == len(ranks)
    return Restored(progress=run["progress"], world_size=run["world_size"], config=run["config"],
                    rank_state=ranks[rank()] if same_world else None, first_rank_state=ranks[0])


def read_whole(folder: Path) -> tuple[dict, dict]:
    """A verified checkpoint folder read whole in this process (the converter's view): ({"centres",
    "optimizer": {index: {name: tensor}}, "backbone"} and, from a run with an EMA, "ema": {name: tensor},
    state.json). "backbone" is backbone.pth, the exported backbone (with an EMA the averages; the trained
    parameters are "ema": training/ema.py's trained_state_dict joins them). Every centre row is held once."""
    verified = verify_folder(folder)
    verify_shards(verified)
    with _quiet_when_alone():
        metadata = SafeReader(folder).read_metadata()
    template: dict = {"optimizer": {}}
    for fqn, md in metadata.state_dict_metadata.items():
        target = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        if fqn == "centres":
            template["centres"] = target
        elif fqn.startswith("optimizer."):
            _, index, name = fqn.split(".", 2)
            template["optimizer"].setdefault(index, {})[name] = target
        elif fqn.startswith("ema."):
            template.setdefault("ema", {})[fqn.split(".", 1)[1]] = target
    try:
        with _quiet_when_alone():
            dcp.load(template, storage_reader=SafeReader(folder), planner=TensorsOnlyPlanner(), **dcp_group(None))
    except CheckpointException as error:
        raise _failure("cannot read", folder, error, f"{_DAMAGED}: convert another run folder") from None
    template["backbone"] = load_torch_file(folder / BACKBONE_NAME,
                                           lambda reason: damaged(folder, f"{BACKBONE_NAME}: {reason}"))
    return template, verified.content


def read_rows(verified: Verified, fqn: str, first: int, count: int, group=None) -> torch.Tensor:
    """Rows first..first+count-1 of the checkpoint's matrix `fqn` (the centres: a tool's share of the classes),
    read from whichever shard files hold them, whatever number of processes wrote them: no process holds more
    than its rows. Collective over `group` when there is a process group (DCP plans the reads together)."""
    shape, dtype = verified.tensors[fqn]
    rows = torch.empty((count, *shape[1:]), dtype=dtype)
    try:
        with _quiet_when_alone():
            dcp.load({fqn: row_block(rows, shape[0], first)}, storage_reader=SafeReader(verified.folder),
                     planner=TensorsOnlyPlanner(), **dcp_group(group))
    except CheckpointException as error:
        raise _failure("cannot read", verified.folder, error, f"{_DAMAGED}: use another run folder") from None
    return rows


@contextlib.contextmanager
def _quiet_when_alone() -> Iterator[None]:
    """DCP warns at every save and load without a process group; one process is a supported setup here.
    (Older torch also warns that the ShardedTensor row blocks are deprecated, which they are not there.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", SHARDED_TENSOR_WARNING)
        if not is_initialized():
            warnings.filterwarnings("ignore", DCP_ALONE_WARNING)
        yield


def _write_error(target: Path, error: BaseException) -> CheckpointError:
    system = os_error_behind(error)
    detail = (system.strerror or str(system)) if system is not None else str(error)
    return CheckpointError(f"could not write checkpoint {target} (rank 0: {detail}); the previous checkpoint is "
                           "untouched: free disk space or choose another output folder")


def _failure(what: str, folder: Path, error: CheckpointException, advice: str) -> CheckpointError:
    """One sentence for every rank from DCP's collected per-rank failures: the first failed rank's
    system error (disk full, file missing) if there is one behind it, else its exception."""
    failed_rank, (cause, _) = sorted(error.failures.items())[0]
    system = os_error_behind(cause)
    if system is not None and system.strerror:
        detail = system.strerror + (f": {system.filename}" if system.filename else "")
    else:  # torch's own text runs to paragraphs: its first sentence says what failed
        detail = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0].split('. ')[0]}"
    return CheckpointError(f"{what} checkpoint {folder} (rank {failed_rank}: {detail}); {advice}")
