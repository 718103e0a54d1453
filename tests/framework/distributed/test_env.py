"""Rank discovery: torchrun variables, then SLURM's (through submitit), else one process."""

import pytest

from framework.distributed.env import DistEnv, detect

SLURM = {
    "SLURM_JOB_ID": "4321",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08,11]",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "3",
}


@pytest.fixture
def clean(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", *SLURM):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_single_process(clean):
    assert detect() == DistEnv(0, 1, 0, "single")


def test_torchrun_wins(clean):
    for k, v in {**SLURM, "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}.items():
        clean.setenv(k, v)
    assert detect() == DistEnv(2, 4, 2, "torchrun")


def test_slurm_tasks_rendezvous_on_the_first_node_with_a_stable_port(clean):
    import os

    for k, v in SLURM.items():
        clean.setenv(k, v)
    assert detect() == DistEnv(5, 8, 1, "slurm")
    assert os.environ["MASTER_ADDR"] == "gpu07"
    port = os.environ["MASTER_PORT"]
    clean.delenv("MASTER_PORT")
    detect()  # a requeued job keeps its id, hence its port
    assert os.environ["MASTER_PORT"] == port and 20000 <= int(port) < 40000


def test_a_one_task_slurm_job_is_a_single_process(clean):
    for k, v in {**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        clean.setenv(k, v)
    assert detect() == DistEnv(0, 1, 0, "single")


def test_jobs_of_one_sweep_get_different_ports(clean):
    import os

    ports = set()
    for job_id, task in (("101", "0"), ("102", "1")):  # an array: one base id, one SLURM_JOB_ID each
        for k, v in {**SLURM, "SLURM_JOB_ID": job_id, "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": task}.items():
            clean.setenv(k, v)
        clean.delenv("MASTER_PORT", raising=False)
        detect()
        ports.add(os.environ["MASTER_PORT"])
    assert len(ports) == 2
