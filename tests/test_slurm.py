"""Slurm: the device a task gets with one GPU of its own, torchrun's variables derived from Slurm's, and the
two sbatch scripts of slurm/ run end to end on this CPU.

Without Slurm here, `srun` and `scontrol` are stand-ins written below: srun starts SLURM_NTASKS copies of
its command on this host, each with the variables srun gives a task (SLURM_PROCID, SLURM_LOCALID, the
step's node count) on top of the job's (SLURM_NTASKS, SLURM_JOB_NODELIST, SLURM_JOB_ID,
SLURM_JOB_NUM_NODES). Everything after them (the scripts, train.py, the process group over gloo) runs
for real. Where a test needs a GPU that is not there,
it replaces torch's hardware queries only, as tests/test_gpu_readiness.py does.
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_acceptance.runs import arguments
from tests.run_helpers import ROOT
from utils.device import choose_device
from utils.errors import ConfigError
from utils.launcher import first_host, local_process, srun_environment

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID")
FAKE_SRUN = """#!/usr/bin/env bash
# srun's stand-in: SLURM_NTASKS tasks of the command on this host (srun's own options are skipped).
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((task = 0; task < SLURM_NTASKS; task++)); do
    SLURM_PROCID=$task SLURM_LOCALID=$task SLURM_STEP_NUM_NODES=1 "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# `scontrol show hostnames LIST` for a list of one host
echo "$3"
"""


def test_one_gpu_per_task_is_device_0_whatever_the_local_id(monkeypatch):
    """srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES names the task's one GPU while SLURM_LOCALID counts 0..7,
    and without --ntasks-per-node no SLURM_NTASKS_PER_NODE is set."""
    for name in (*LAUNCH_VARIABLES, "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert local_process() == (3, None)
    assert choose_device("auto", *local_process()) == torch.device("cuda", 0) and chosen == [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # srun --gpus-per-node=8: every task sees all 8
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert choose_device("auto", *local_process()) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # --gpus-per-task=2: index 3 fits neither rule
    with pytest.raises(ConfigError, match=r"^process 3 on this node sees 2 GPUs \(CUDA_VISIBLE_DEVICES="
                                          r"0,1,2,3,4,5,6,7\), fewer than its index; give every task all of the "
                                          r"node's GPUs \(--gpus-per-node"):
        choose_device("auto", *local_process())


def sbatch_options(script: str) -> dict[str, str]:
    """The `#SBATCH --key[=value]` lines of slurm/<script> (a flag's value: "")."""
    lines = (ROOT / "slurm" / script).read_text().splitlines()
    return dict((*line.removeprefix("#SBATCH --").split("=", 1), "")[:2] for line in lines
                if line.startswith("#SBATCH --"))


def test_the_srun_script_shows_every_task_its_nodes_gpus_and_each_takes_its_own(monkeypatch):
    """--gpus-per-node: each task sees all of its node's GPUs (what NCCL needs to reach them peer to peer),
    one task per GPU, and SLURM_LOCALID picks a different GPU for each task of the node."""
    options = sbatch_options("train_srun.sbatch")
    assert "gpus-per-task" not in options
    gpus = int(options["gpus-per-node"])
    assert int(options["ntasks-per-node"]) == gpus
    for name in (*LAUNCH_VARIABLES, "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus))))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    chosen = []
    for task in range(gpus):
        monkeypatch.setenv("SLURM_LOCALID", str(task))
        chosen.append(choose_device("auto", *local_process()))
    assert chosen == [torch.device("cuda", index) for index in range(gpus)]


def test_torchrun_processes_sharing_one_gpu_are_still_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^8 processes on this node but 1 GPU\(s\) visible"):
        choose_device("auto", 0, 8)


@pytest.mark.parametrize("nodelist, first", [
    ("localhost", "localhost"), ("node1,node2", "node1"), ("gpu[007-009,012],cpu01", "gpu007"),
    ("gpu[3]", "gpu3"), ("rack[1-2]-n[01-04],x", "rack1-n01"), ("a-b01", "a-b01")])
def test_the_first_host_of_a_slurm_host_list(nodelist, first):
    assert first_host(nodelist) == first


def test_torchruns_variables_come_from_slurms_unless_set():
    job = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[12-13]",
           "SLURM_JOB_ID": "4812345"}
    assert srun_environment(job) == {"RANK": "5", "WORLD_SIZE": "16", "MASTER_ADDR": "gpu12", "MASTER_PORT": "17345"}
    assert srun_environment({**job, "SLURM_JOB_ID": "77"})["MASTER_PORT"] == "15077"
    assert srun_environment({**job, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == {"RANK": "5",
                                                                                           "WORLD_SIZE": "16"}
    assert srun_environment({**job, "RANK": "5", "WORLD_SIZE": "16"}) == {}  # torchrun's own (srun + torchrun)
    assert srun_environment({**job, "SLURM_NTASKS": "1"}) == {}  # one task: one process, no process group
    assert srun_environment({"SLURM_NTASKS": "16"}) == {}  # salloc's shell: no task of srun
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST is not set.*; export MASTER_ADDR"):
        srun_environment({key: value for key, value in job.items() if key != "SLURM_JOB_NODELIST"})


def free_job_id() -> str:
    """A job id whose port (15000 + its last four digits) is free here."""
    for last_four in random.sample(range(10000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", 15000 + last_four))
            except OSError:
                continue
        return f"98{last_four:04d}"
    raise RuntimeError("no free port in 15000..24999")


def fake_slurm_tools(folder: Path) -> Path:
    """A folder holding the fake srun and scontrol, written once before any job runs them (rewriting one that a
    running job executes fails that exec with ETXTBSY)."""
    tools = folder / "slurm-bin"
    tools.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    return tools


def start_script(script: str, data: Path, output: Path, tools: Path, tasks: int, **extra: str) -> subprocess.Popen:
    """`bash slurm/<script> CONFIG --set ...` in a one-node job of `tasks` tasks on localhost."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES and
           not key.startswith("SLURM_")}
    env.update(PATH=f"{tools}:{env['PATH']}", PYTHON=sys.executable, OMP_NUM_THREADS="1", SLURM_NTASKS=str(tasks),
               SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=free_job_id(), SLURM_JOB_NUM_NODES="1",
               **extra)
    command = ["bash", f"slurm/{script}", *arguments(data, output, "max_steps=2")]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def slurm_runs(data, tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    """Both scripts, side by side: srun per task (2 tasks), and srun + torchrun (1 node, 2 processes)."""
    tmp = tmp_path_factory.mktemp("slurm")
    tools = fake_slurm_tools(tmp)
    started = {"train_srun.sbatch": start_script("train_srun.sbatch", data, tmp / "per_task", tools, tasks=2),
               "train_torchrun.sbatch": start_script("train_torchrun.sbatch", data, tmp / "torchrun", tools, tasks=1,
                                                     GPUS_PER_NODE="2")}
    runs = {}
    for (script, process), output in zip(started.items(), (tmp / "per_task", tmp / "torchrun"), strict=True):
        out, err = process.communicate(timeout=400)
        runs[script] = (output, process.returncode, out[-3000:] + err[-3000:])
    return runs


@pytest.mark.parametrize("script", ["train_srun.sbatch", "train_torchrun.sbatch"])
def test_each_sbatch_script_forms_one_process_group_of_two_and_trains(slurm_runs, script):
    """srun per task: two processes given only Slurm's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
    SLURM_JOB_NODELIST naming localhost, SLURM_JOB_ID for the port) find each other and train 2 steps."""
    output, status, text = slurm_runs[script]
    assert status == 0, text
    log = (output / "training.log").read_text()
    assert "backend gloo, 2 process(es) on 1 node(s)" in log, log
    assert "training finished at global step 2" in log
