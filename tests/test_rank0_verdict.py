"""utils.rank0_verdict against a real TCPStore served here, as torchrun's agent serves its workers: a rank
other than 0 learns rank 0's verdict only once rank 0 tells it, per phase and per torchrun restart."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.run_helpers import free_port
from utils.rank0_verdict import CONFIG_ERROR, NO_CONFIG_ERROR, announce_verdict, rank0_had_config_error


@pytest.fixture
def agent_store(monkeypatch):
    """A TCPStore server like torchrun's agent's, and the variables torchrun gives its workers."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    for name, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    yield server
    del server


def hear_in_background(phase: str, timeout: timedelta = timedelta(seconds=60)) -> tuple[threading.Thread, list]:
    heard: list[bool] = []
    thread = threading.Thread(target=lambda: heard.append(rank0_had_config_error(phase, timeout)), daemon=True)
    thread.start()
    return thread, heard


@pytest.mark.parametrize(("verdict", "expected"), [(CONFIG_ERROR, True), (NO_CONFIG_ERROR, False)])
def test_a_rank_learns_rank0s_verdict_once_it_is_told(agent_store, verdict, expected):
    thread, heard = hear_in_background("startup")  # waits: nothing has been told yet
    announce_verdict("startup", verdict)
    thread.join(60)
    assert heard == [expected]
    assert agent_store.get("pairface/restart0/startup").decode() == verdict


def test_verdicts_of_other_phases_or_restarts_are_not_heard(agent_store, monkeypatch):
    announce_verdict("startup", CONFIG_ERROR)
    assert not rank0_had_config_error("training", timedelta(seconds=0.5))  # rank 0 said nothing of it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun started the workers again
    assert not rank0_had_config_error("startup", timedelta(seconds=0.5))
    announce_verdict("startup", CONFIG_ERROR)
    assert rank0_had_config_error("startup")


def test_outside_torchrun_s_agent_store_nothing_waits(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    announce_verdict("startup", NO_CONFIG_ERROR)  # nobody listens: a no-op
    assert rank0_had_config_error("startup", timedelta(days=1))  # the error is the same on every process
