"""Training runs side by side: one table and one plot of their verification curves.

    python -m eval.compare output/r50_pair output/r50_single
    python -m eval.compare output/a output/b output/c --plot runs.png

Each argument is a run folder train.py wrote. From its model.json: the network (and its options) and
the number of classes; from its config.json, the run's record of its config: the margin family and the config
keys whose values differ between the runs (as of its last save: a resume may change some; a folder
without that record, written by an earlier pairface or not saved yet, gives them by its training.log's last
config line); from its training.log: the last global step, images/s (the median
over the logged speed lines) and, per verification set, the last and the best Accuracy-Flip, each with its
folds' spread (a resumed run's log repeats steps: the latest line of a step counts, as TensorBoard shows it);
from checkpoint.json: the step of the last checkpoint saved (what --resume continues from); from the
``backbone_<target>_tar.json`` files eval.ijb writes beside the weights: TAR at FAR 1e-4 and 1e-5 on
each IJB target. A set or target a run did not measure shows "-". The plot draws one panel per
verification set, Accuracy-Flip over global steps, one line per run (a run that did not measure the
set is named in its legend as such). Without --plot it goes to runs_compared.png here, or to the first free
runs_compared-<n>.png beside it when that file exists: an earlier plot is never overwritten unless named.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from backbones.trained import BACKBONE_NAME, MODEL_INFO_NAME
from eval.table import boxed_table
from margin_families import FAMILIES
from utils.cli import exit_on_user_error
from utils.errors import ConfigError, DataError, located

LOG_NAME = "training.log"
POINTER_NAME = "checkpoint.json"  # the checkpoint package's pointer to the last save (a layer above eval's)
RUN_CONFIG_NAME = "config.json"   # the checkpoint package's record of the run's config (checkpoint/run_dir.py)
IJB_FARS = ("0.0001", "1e-05")
_ACCURACY = re.compile(r"\[([^\]\s]+)\]\[(\d+)\]Accuracy-Flip: ([\d.]+)\+-([\d.]+)")
# An earlier pairface's run folder has no config values in config.json: its log's config line holds them.
_CONFIG = re.compile(r"^Training: .*?-config: (.*)$", re.MULTILINE)
_CONFIG_ITEM = re.compile(r", (?=[a-z_0-9]+=)")  # between two key=value items (values may hold ", ")
_ALWAYS_DIFFERENT = ("output",)  # every run has its own folder: not a difference worth a column
DEFAULT_PLOT = Path("runs_compared.png")
_SPEED = re.compile(r"Speed [\d.]+ samples/sec ([\d.]+) images/sec .*Global Step: (\d+)")
_FINISHED = re.compile(r"training finished at global step (\d+)")
_TAR_FILE = re.compile(r"^" + re.escape(os.path.splitext(BACKBONE_NAME)[0]) + r"_(\w+)_tar\.json$")


@dataclass
class RunSummary:
    name: str
    network: str
    classes: int | None
    steps: int | None
    images_per_second: float | None
    accuracy: dict[str, dict[int, float]] = field(default_factory=dict)  # set -> step -> Accuracy-Flip
    spread: dict[str, dict[int, float]] = field(default_factory=dict)    # set -> step -> the folds' std
    tar: dict[str, dict[str, float]] = field(default_factory=dict)       # IJB target -> FAR -> TAR
    config: dict[str, str] = field(default_factory=dict)                 # key -> value as Python writes it
    saved_step: int | None = None                                        # of the last checkpoint saved


def _read_model_info(folder: Path) -> tuple[str, int | None]:
    path = folder / MODEL_INFO_NAME
    fix = "pass a run folder train.py wrote (it holds model.json beside backbone.pth)"
    if not path.is_file():
        raise DataError(f"run folder {folder} holds no {MODEL_INFO_NAME}; {fix}")
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path} cannot be read as JSON ({error}); {fix}") from None
    if not isinstance(info, dict) or not isinstance(info.get("network"), str):
        raise DataError(f"{path} names no network; {fix}")
    options = info.get("network_kwargs") or {}
    described = info["network"] + (f" ({', '.join(f'{k}={v}' for k, v in options.items())})"
                                    if isinstance(options, dict) and options else "")
    classes = info.get("num_classes")
    return described, classes if isinstance(classes, int) else None


def _read_tar_tables(folder: Path) -> dict[str, dict[str, float]]:
    tables = {}
    for path in sorted(folder.iterdir()):
        match = _TAR_FILE.match(path.name)
        if not match:
            continue
        try:
            table = json.loads(path.read_text())["tar_at_far"]
            tables[match.group(1).upper()] = {far: float(table[far]) for far in IJB_FARS if far in table}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise DataError(f"{path} is not a TAR table as eval.ijb writes it ({error}); run eval.ijb again or "
                            "delete the file") from None
    return tables


def read_run(folder: str | os.PathLike) -> RunSummary:
    """What one run folder says about its run (see the module doc)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"run folder {located(folder)} does not exist; pass folders train.py wrote, e.g. output/run")
    network, classes = _read_model_info(folder)
    log_path = folder / LOG_NAME
    try:
        log = log_path.read_text(errors="replace")
    except OSError as error:
        raise DataError(f"run folder {folder} has no readable {LOG_NAME} ({error.strerror}); pass a folder "
                        "train.py wrote") from None
    accuracy: dict[str, dict[int, float]] = {}
    spread: dict[str, dict[int, float]] = {}
    for name, step, value, std in _ACCURACY.findall(log):
        accuracy.setdefault(name, {})[int(step)] = float(value)
        spread.setdefault(name, {})[int(step)] = float(std)
    speeds = [float(images) for images, _ in _SPEED.findall(log)]
    steps = [int(step) for _, step in _SPEED.findall(log)] + [int(step) for step in _FINISHED.findall(log)]
    steps += [step for curve in accuracy.values() for step in curve]
    return RunSummary(name=str(folder), network=network, classes=classes, steps=max(steps) if steps else None,
                      images_per_second=statistics.median(speeds) if speeds else None, accuracy=accuracy,
                      spread=spread, tar=_read_tar_tables(folder), config=_read_config(folder, log),
                      saved_step=_saved_step(folder))


def _read_config(folder: Path, log: str) -> dict[str, str]:
    """Every config key of the run as of its last save, its value as Python writes it (so that both sources
    read alike): from config.json's record, else from the log's last config line (an earlier pairface's folder,
    or a run not saved yet); {} when neither says."""
    path = folder / RUN_CONFIG_NAME
    if path.is_file():
        fix = "pass a run folder train.py wrote, or move the damaged config.json away"
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise DataError(f"{path} cannot be read as JSON ({error}); {fix}") from None
        config = record.get("config") if isinstance(record, dict) else record
        if isinstance(config, dict):
            return {key: repr(_as_loaded(value)) for key, value in config.items()}
        if config is not None:  # None: an earlier pairface's record, of the config file and --set alone
            raise DataError(f"{path} holds no mapping of config keys to values under 'config'; {fix}")
    configs = _CONFIG.findall(log)
    return dict(item.split("=", 1) for item in _CONFIG_ITEM.split(configs[-1])) if configs else {}


def _as_loaded(value: object) -> object:
    """A JSON value as the config loader holds it: JSON has lists where the config has tuples."""
    if isinstance(value, list):
        return tuple(_as_loaded(item) for item in value)
    if isinstance(value, dict):
        return {key: _as_loaded(item) for key, item in value.items()}
    return value


def _saved_step(folder: Path) -> int | None:
    """The global step of the checkpoint checkpoint.json points at, if there is one."""
    pointer = folder / POINTER_NAME
    if not pointer.is_file():
        return None
    try:
        step = json.loads(pointer.read_text())["global_step"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        step, reason = None, f"{type(error).__name__}: {error}"
    else:
        reason = f"its global_step is {step!r}"
    if not isinstance(step, int) or isinstance(step, bool):
        raise DataError(f"{pointer} does not say which step was saved ({reason}); pass a run folder train.py wrote, "
                        "or move the damaged checkpoint.json away")
    return step


def _margin(config: dict[str, str]) -> str:
    """The family and the keys its declaration shows (a family this version does not know: its name alone)."""
    name = config.get("margin_family", "'combined'").strip("'")
    shown = FAMILIES[name].shown if name in FAMILIES else ()
    return " ".join([name, *(config.get(key, "") for key in shown), f"s={config.get('margin_scale', '?')}"])


def differing_keys(runs: Sequence[RunSummary]) -> list[str]:
    """The config keys whose values are not the same in every run (a run without a config record counts as
    different), sorted; the keys the margin column shows are left to it."""
    shown = {key for family in FAMILIES.values() for key in family.shown}
    keys = sorted({key for run in runs for key in run.config} - set(_ALWAYS_DIFFERENT)
                  - {"margin_family", "margin_scale", *shown})
    return [key for key in keys if len({run.config.get(key) for run in runs}) > 1]


def _cell(value: float | int | None, text: str = "{}") -> str:
    return "-" if value is None else text.format(value)


def comparison_table(runs: Sequence[RunSummary]) -> str:
    """One row per run; one last/best column pair per verification set any run measured, one column per
    IJB target and FAR any run has."""
    sets = sorted({name for run in runs for name in run.accuracy})
    targets = sorted({target for run in runs for target in run.tar})
    differing = differing_keys(runs)
    header = ["run", "network", "margin", "differs", "classes", "steps", "saved"]
    header += [f"{name} {kind}" for name in sets for kind in ("last", "best")]
    header += [f"{target} TAR@FAR={float(far):g}" for target in targets for far in IJB_FARS]
    header.append("images/s")
    body = []
    for run in runs:
        differs = ", ".join(f"{key}={run.config.get(key, '-')}" for key in differing) or "-"
        row = [run.name, run.network, _margin(run.config) if run.config else "-", differs, _cell(run.classes),
               _cell(run.steps), _cell(run.saved_step)]
        for name in sets:
            curve, spread = run.accuracy.get(name), run.spread.get(name, {})
            if curve:
                last, best = max(curve), max(curve, key=lambda step: (curve[step], -step))
                row += [f"{curve[last]:.5f}+-{spread[last]:.5f}", f"{curve[best]:.5f}+-{spread[best]:.5f}"]
            else:
                row += ["-", "-"]
        for target in targets:
            row += [_cell(run.tar.get(target, {}).get(far), "{:.4f}") for far in IJB_FARS]
        row.append(_cell(run.images_per_second, "{:.1f}"))
        body.append(row)
    return boxed_table(header, body)


def save_curves(runs: Sequence[RunSummary], path: str | os.PathLike) -> None:
    """One panel per verification set: Accuracy-Flip over global steps, one line (with markers) per run."""
    import matplotlib  # noqa: PLC0415 (~1 s, only where a plot is written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sets = sorted({name for run in runs for name in run.accuracy})
    fig, axes = plt.subplots(1, max(len(sets), 1), figsize=(6.4 * max(len(sets), 1), 4.8), squeeze=False)
    for ax, name in zip(axes[0], sets):
        for run in runs:
            curve = run.accuracy.get(name)
            if curve:
                steps = sorted(curve)
                ax.plot(steps, [curve[step] for step in steps], marker="o", lw=1.5, label=run.name)
            else:  # named in the legend all the same, so that a missing line is explained
                ax.plot([], [], label=f"{run.name} (not measured)")
        ax.set_title(f"{name}: Accuracy-Flip")
        ax.set_xlabel("global step")
        ax.set_ylabel("Accuracy-Flip")
        ax.grid(linestyle="--", linewidth=0.5)
        ax.legend(loc="best")
    if not sets:
        axes[0][0].set_title("no run verified a set")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def free_plot_path(default: Path) -> Path:
    """``default``, or the first ``<stem>-<n>.png`` beside it that does not exist yet."""
    path, number = default, 1
    while path.exists():
        number += 1
        path = default.with_name(f"{default.stem}-{number}{default.suffix}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folders train.py wrote")
    parser.add_argument("--plot", type=Path,
                        help=f"where to write the PNG of verification curves, replacing a file there (default: "
                             f"{DEFAULT_PLOT} here, or {DEFAULT_PLOT.stem}-<n>.png when that exists)")
    args = parser.parse_args(argv)
    with exit_on_user_error():
        plot = args.plot or free_plot_path(DEFAULT_PLOT)
        if not plot.parent.is_dir():
            raise ConfigError(f"--plot {plot} is in a folder that does not exist; create {plot.parent} "
                            "first or choose another path")
        runs = [read_run(folder) for folder in args.runs]
        print(comparison_table(runs))
        save_curves(runs, plot)
        kept = f" ({DEFAULT_PLOT} was there already: kept)" if plot != DEFAULT_PLOT and args.plot is None else ""
        print(f"verification curves: {plot}{kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
