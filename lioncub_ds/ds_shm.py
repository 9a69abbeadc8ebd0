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


def workspace_name(uid: int, addr: str, port, rank: int) -> str:
    """DeepSpeed's name for a rank's workspace (shm.cpp: prefix, uid, MASTER_ADDR, MASTER_PORT, rank)."""
    return f"{SHM_WORKSPACE_PREFIX}{uid}_{addr}_{port}_{rank}"


def own_shm_workspace(rank: int) -> str:
    """This rank's workspace name, as DeepSpeed builds it from the launch environment."""
    return workspace_name(os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), rank)


def workspace_port(name: str):
    """(uid, port) of a workspace name, or None for a name that is not one. The port is the launch's
    (MASTER_PORT): what tells one launch's workspaces from another's on a shared machine."""
    if not name.startswith(SHM_WORKSPACE_PREFIX):
        return None
    uid, _, rest = name[len(SHM_WORKSPACE_PREFIX):].partition("_")
    head, _, rank = rest.rpartition("_")  # MASTER_ADDR may hold "_" (a host name): split from the right
    _, _, port = head.rpartition("_")
    if not (uid.isdigit() and rank.isdigit()):
        return None
    return int(uid), port


def launch_workspaces(ports) -> set:
    """This user's workspaces of the launches on these ports (MASTER_PORT values). Never another
    job's: a launch that took its port from the OS shares it with no live job, and a rank of a
    live job loops on ``open()`` until its peers' workspaces exist (shm.cpp), so removing the
    workspaces of a job still starting would hang it."""
    ports = {str(p) for p in ports}
    return {n for n in shm_workspaces() if workspace_port(n) in {(os.getuid(), p) for p in ports}}


@contextmanager
def removing_launch_workspaces(port):
    """Around a DeepSpeed CPU launch on ``port`` (run by this process's children): afterwards,
    remove the workspaces it left (those named with its port, by this user, that appeared meanwhile)."""
    before = launch_workspaces([port])
    try:
        yield
    finally:
        remove_shm_workspaces(launch_workspaces([port]) - before)
