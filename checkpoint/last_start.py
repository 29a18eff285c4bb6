"""How the last start of a run folder ended, read from its training.log: with a line of its own (finished,
stopped, preempted, an error), or killed with none (SIGKILL: the OOM killer, a scheduler's grace period run out,
a power cut; or a crash whose traceback went to stderr alone), and whether it had promised a checkpoint (on
SIGTERM or SIGUSR1) that it never wrote.

Every start writes its config first (`config: ...`); every way a run ends by itself writes one of END_LINES after
it. The log is read from its end (its last MiB): a run's log grows without bound, its last start does not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from checkpoint.pointer import TMP_FOLDER_PREFIX
from utils.log import LOG_NAME

START_LINE = "config: "
# The first words of the lines a run ends with by itself (train.py, utils/cli.py's `error: ` for every stop on an
# error, the lost peer's included); a start whose log has none after its START_LINE was killed.
END_LINES = ("training finished at ", "nothing was trained", "preempted at ", "stopped at global step ",
             "stopped by Ctrl-C", "stopped at once by a second Ctrl-C", "error: ")
PROMISE = re.compile(r"(\w+): saving a checkpoint after this step, then stopping")
_LINE = re.compile(r"Training(?:\[rank \d+\])?: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+-(.*)")
_STEP = re.compile(r"Global Step: (\d+)\b")
_TAIL = 1 << 20


@dataclass(frozen=True)
class KilledStart:
    """A start of a run that ended without a line of its own."""

    last_step: int | None  # the last global step its log shows; None: it logged none
    promised: str | None   # the signal whose checkpoint it had promised ("SIGTERM"), None if none
    unfinished_saves: tuple[str, ...]  # the folders of saves it began and did not finish (.tmp-checkpoint-<step>)

    def describe(self) -> str:
        """What happened, in the words of one log line's first clause."""
        where = f" after global step {self.last_step}" if self.last_step is not None else " before its first step"
        promise = (f", {self.promised} having asked it to save a checkpoint, which it never finished"
                   if self.promised else "")
        unfinished = (f" ({', '.join(self.unfinished_saves)}/ is a save it began and did not finish)"
                      if self.unfinished_saves else "")
        return (f"its last start ended{where} with no line of its own in training.log{promise}: it was killed "
                f"(SIGKILL: the OOM killer, a scheduler's grace period run out, a power cut) or crashed (a traceback "
                f"on its stderr){unfinished}")


def killed_start(output: str | Path) -> KilledStart | None:
    """The last start in `output` when it was killed; None when it ended with a line of its own, or when the
    folder holds no start of a run."""
    folder = Path(output)
    try:
        with open(folder / LOG_NAME, "rb") as file:
            file.seek(0, 2)
            file.seek(max(0, file.tell() - _TAIL))
            text = file.read().decode(errors="replace")
    except OSError:
        return None
    messages = [match.group(1) for line in text.splitlines() if (match := _LINE.fullmatch(line))]
    starts = [i for i, message in enumerate(messages) if message.startswith(START_LINE)]
    if not starts:
        return None
    last = messages[starts[-1]:]
    if any(message.startswith(END_LINES) for message in last):
        return None
    steps = [int(match.group(1)) for message in last if (match := _STEP.search(message))]
    promises = [match.group(1) for message in last if (match := PROMISE.match(message))]
    unfinished = tuple(sorted(path.name for path in folder.glob(f"{TMP_FOLDER_PREFIX}*") if path.is_dir()))
    return KilledStart(steps[-1] if steps else None, promises[-1] if promises else None, unfinished)
