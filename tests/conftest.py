"""Suite-wide fixtures."""
import pytest

from lioncub_ds.ds_shm import removing_new_shm_workspaces


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_workspaces():
    """DeepSpeed's CPU accelerator leaves a ~66 MB /dev/shm workspace per rank and launch
    (lioncub_ds.ds_shm); without this, one run of the suite left several GB of RAM behind."""
    with removing_new_shm_workspaces():
        yield
