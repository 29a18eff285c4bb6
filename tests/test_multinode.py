"""Several nodes, simulated on one machine with two torchrun launchers on 127.0.0.1: a 2 nodes x 2
processes run is SIGKILLed mid-run and resumed as 1 node x 3 processes; a checkpoint with a shard
missing stops every rank at once with the same one-line error instead of hanging."""
from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from checkpoint.pointer import POINTER_NAME
from gpu_acceptance.runs import INFO, arguments, load_run
from tests.forked_commands import ForkedCommand
from tests.run_helpers import free_port, kill_node, run_cli, start_command

OVERRIDES = ("save_every_steps=1", "num_epoch=100")  # a save after every step; never ends on its own
pytestmark = pytest.mark.slow  # six training processes on two cores


def start_node(node_rank: int, port: int, data: Path, output: Path) -> ForkedCommand:
    return start_command([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
                          "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}", "train.py",
                          *arguments(data, output, *OVERRIDES)])


def published_step(output: Path) -> int:
    try:
        return json.loads((output / POINTER_NAME).read_text())["global_step"]
    except (OSError, ValueError):
        return 0


@pytest.fixture(scope="module")
def killed_two_node_run(data, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("nodes") / "run"
    port = free_port()
    nodes = [start_node(rank, port, data, output) for rank in (0, 1)]
    deadline = time.monotonic() + 240
    while published_step(output) < 3 and time.monotonic() < deadline and all(n.poll() is None for n in nodes):
        time.sleep(0.1)
    for node in nodes:
        kill_node(node)
    errors = [node.communicate()[1][-2000:] for node in nodes]
    assert published_step(output) >= 3, errors
    return output


def test_a_killed_two_node_run_resumes_on_one_node_with_three_processes(data, killed_two_node_run, tmp_path):
    output = Path(shutil.copytree(killed_two_node_run, tmp_path / "run"))
    assert "backend gloo, 4 process(es) on 2 node(s)" in (output / "training.log").read_text()
    saved = load_run(output)
    assert saved["world_size"] == 4
    step = saved["progress"]["global_step"]
    # 40 records: 4 processes x 2 batches of 4 per epoch -> 3 processes x 3 batches; step s of 2 becomes
    # round(s * 3 / 2) of 3
    renumbered = round(step * 3 / 2)
    result = run_cli(data, output, *OVERRIDES, f"max_steps={renumbered + 2}", nproc=3, resume=True)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (output / "training.log").read_text()
    assert (f"resuming a run of 4 process(es) and 2 steps per epoch with 3 and 3: step {step} becomes step "
            f"{renumbered}") in log
    resumed = load_run(output)
    assert resumed["world_size"] == 3 and resumed["progress"]["global_step"] == renumbered + 2
    assert tuple(resumed["class_centres"].shape) == (INFO["num_classes"], INFO["embedding_size"])


def test_a_missing_shard_stops_every_rank_with_the_same_line(data, killed_two_node_run, tmp_path):
    output = Path(shutil.copytree(killed_two_node_run, tmp_path / "run"))
    folder = output / json.loads((output / POINTER_NAME).read_text())["directory"]
    (folder / "__1_0.distcp").unlink()
    # Ended at all: a rank waiting for its peer in a collective would wait out timeout_minutes (30 by default), far
    # past run_cli's bound, which fails the test.
    result = run_cli(data, output, *OVERRIDES, nproc=2, resume=True)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    messages = sorted(re.sub(r"^error: (\[rank 1\] )?", "", line) for line in lines)
    assert len(messages) == 2 and messages[0] == messages[1], result.stderr[-3000:]
    assert messages[0].startswith(f"checkpoint {folder} is damaged ({folder / '__1_0.distcp'} is missing)")
