"""utils.progress: silent for library callers, a line per tenth into logs and pipes, a tqdm bar on a terminal."""
from __future__ import annotations

import io
import re

from utils.progress import progress


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as sys.stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


def test_without_a_stream_items_pass_through_and_nothing_is_written(capsys):
    assert list(progress(iter(range(5)), 5, "work")) == [0, 1, 2, 3, 4]
    captured = capsys.readouterr()
    assert captured.out == captured.err == ""


def test_a_file_or_pipe_gets_one_line_per_tenth():
    stream = io.StringIO()
    assert list(progress(range(25), None, "encoding", stream)) == list(range(25))  # total from len()
    lines = stream.getvalue().splitlines()
    # Tenth t is reached at item ceil(25 t / 10): 3, 5, 8, 10, 13, 15, 18, 20, 23, 25.
    assert [re.sub(r", \d+ s\)$", ")", line) for line in lines] == [
        f"encoding: {10 * t}% ({done}/25)" for t, done in enumerate((3, 5, 8, 10, 13, 15, 18, 20, 23, 25), 1)]

    few = io.StringIO()
    list(progress(range(3), 3, "few", few))  # fewer items than tenths: one line per item, its latest tenth
    assert [line.split(" (")[0] for line in few.getvalue().splitlines()] == ["few: 30%", "few: 60%", "few: 100%"]

    unknown = io.StringIO()
    list(progress(iter(range(4)), None, "stream", unknown))  # no total: one line at the end
    assert re.fullmatch(r"stream: 4 done \(\d+ s\)\n", unknown.getvalue())


def test_a_terminal_gets_a_tqdm_bar():
    stream = Terminal()
    assert list(progress(range(40), 40, "embedding", stream)) == list(range(40))
    text = stream.getvalue()
    assert "\r" in text  # redrawn in place, not a line per update
    final = text.split("\r")[-1]
    assert final.startswith("embedding: 100%|") and "40/40" in final
