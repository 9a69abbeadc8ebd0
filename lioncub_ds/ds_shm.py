"""DeepSpeed's CPU shared-memory all-reduce workspaces, and removing the ones it leaves behind.

Standard library only, so launchers can use it without importing DeepSpeed.
"""
from __future__ import annotations

import os
from contextlib import contextmanager


# DeepSpeed's CPU accelerator maps one shared-memory all-reduce workspace per rank
# (ops/csrc/cpu/comm/shm.cpp: /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>,
# about 66 MB each) and never unlinks it, so every CPU launch leaves N of them in RAM until a
# reboot (a full `make test` left several GB). Removing the names once the ranks are done is safe:
# a mapping outlives its name.
SHM_DIR = "/dev/shm"
SHM_WORKSPACE_PREFIX = "deepspeed_allreduce_buffer_"


def shm_workspaces() -> set:
    """Names of DeepSpeed CPU all-reduce workspaces in /dev/shm (empty where there is none)."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_WORKSPACE_PREFIX)}
    except OSError:
        return set()


def remove_shm_workspaces(names) -> int:
    """Unlink these workspace names; returns how many were removed."""
    removed = 0
    for name in names:
        if not name.startswith(SHM_WORKSPACE_PREFIX) or "/" in name:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except OSError:
            pass
    return removed


def own_shm_workspace(rank: int) -> str:
    """This rank's workspace name, as DeepSpeed builds it from the launch environment."""
    return (f"{SHM_WORKSPACE_PREFIX}{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


@contextmanager
def removing_new_shm_workspaces():
    """Around a DeepSpeed CPU launch (run by this process's children): afterwards, remove the
    workspaces that appeared meanwhile."""
    before = shm_workspaces()
    try:
        yield
    finally:
        remove_shm_workspaces(shm_workspaces() - before)
