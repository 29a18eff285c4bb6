"""A checkpoint's `state.json`, checked field by field before any of it is used.

The run's description (model, config, world size) is checked here; every component of the one registry
(training.state.COMPONENTS) checks its own fields, in `run` or, for each process's own state, in every entry of
`ranks`, so that a file that does not hold what pairface writes is one line naming the field. Keys nothing
reads are let through.
"""
from __future__ import annotations

from collections.abc import Mapping

from training.fields import StateFieldError, field, integer, json_list, json_object, number
from training.state import COMPONENTS

STATE_NAME = "state.json"  # in every checkpoint folder, beside DCP's shards


def check_state(content: Mapping) -> None:
    """StateFieldError for the first field of `content` (state.json, its checksum removed) that a resume
    could not use as it is."""
    run = json_object(field(content, "run", ""), "run")
    json_object(field(run, "model", "run"), "run.model")
    _check_config(json_object(field(run, "config", "run"), "run.config"))
    world_size = integer(field(run, "world_size", "run"), "run.world_size", low=1)
    ranks = json_list(field(content, "ranks", ""), "ranks")
    if len(ranks) != world_size:
        raise StateFieldError("ranks", f"holds {len(ranks)} entries, but run.world_size says {world_size} processes "
                                       "saved one each")
    for component in COMPONENTS:
        if not component.per_rank:
            component.check(run, "run")
            continue
        for index, entry in enumerate(ranks):
            component.check(json_object(entry, f"ranks[{index}]"), f"ranks[{index}]")


def _check_config(config: Mapping) -> None:
    """The values computed with (the LR ratio of a changed lr, the converter's schedule), where present: a key
    the file lacks is a key the resume does not compare; the rest are only compared and shown."""
    if "lr" in config:
        number(config["lr"], "run.config.lr", low=0.0)
    for key in ("num_epoch", "batch_size", "gradient_acc"):
        if key in config:
            integer(config[key], f"run.config.{key}", low=1)
    if "warmup_epoch" in config:
        integer(config["warmup_epoch"], "run.config.warmup_epoch")
