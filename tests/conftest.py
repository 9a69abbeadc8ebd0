"""Suite-wide fixtures."""
import pytest

from lioncub_ds import ds_shm


@pytest.fixture(scope="session")
def _shm_workspaces_before_the_suite():
    return ds_shm.shm_workspaces()


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_workspaces(_shm_workspaces_before_the_suite):
    """DeepSpeed's CPU accelerator leaves a ~66 MB /dev/shm workspace per rank and launch
    (lioncub_ds.ds_shm); one run of the suite once left several GB of RAM behind. After each
    test (whose ranks, and those of the module fixtures before it, have ended) remove every
    workspace that was not there when the suite started."""
    yield
    ds_shm.remove_shm_workspaces(ds_shm.shm_workspaces() - _shm_workspaces_before_the_suite)
