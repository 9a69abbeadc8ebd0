"""Suite-wide fixtures, and the test tiers.

Every test belongs to exactly one tier (markers registered in pytest.ini): ``unit``, ``dist`` or
``integration``. Mark a module with ``pytestmark = pytest.mark.unit``; a test's own tier marker
(a decorator, or ``pytest.param(..., marks=...)``) overrides its module's. A test without a tier,
or with two at the same level, fails the collection, so none can silently escape ``-m unit``.
"""
import pytest

from lioncub_ds import ds_shm
from lioncub_ds.testing import spawn


@pytest.fixture(scope="session")
def _shm_workspaces_before_the_suite():
    return ds_shm.shm_workspaces()


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_workspaces(_shm_workspaces_before_the_suite):
    """DeepSpeed's CPU accelerator leaves a ~66 MB /dev/shm workspace per rank and launch
    (lioncub_ds.ds_shm); one run of the suite once left several GB of RAM behind. After each
    test (whose ranks, and those of the module fixtures before it, have ended) remove the
    workspaces of the suite's own launches: named with a port that free_port() gave this process
    (every launch of the tests takes its port there), by this user, not there when the suite
    started. Another job's workspaces stay, whoever made them: a rank of a DeepSpeed run started
    by hand loops on open() until its peers' workspaces exist, so removing those hangs that run."""
    yield
    ours = ds_shm.launch_workspaces(spawn.ports_given())
    ds_shm.remove_shm_workspaces(ours - _shm_workspaces_before_the_suite)


TIERS = ("unit", "dist", "integration")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: it must see the tier that won
def pytest_collection_modifyitems(config, items):
    """The closest tier marker wins; it becomes the test's only tier marker."""
    problems, chosen = [], {}
    for item in items:
        for node in item.listchain()[::-1]:  # the test itself first, then its class, its module
            names = {m.name for m in node.own_markers if m.name in TIERS}
            if len(names) > 1:
                problems.append(f"{item.nodeid}: several tiers on {node.nodeid or 'the session'}: {sorted(names)}")
            if names:
                chosen[item] = names.pop()
                break
        else:
            problems.append(f"{item.nodeid}: no tier marker")
    if problems:
        raise pytest.UsageError(
            "every test needs exactly one tier marker (" + ", ".join(TIERS) + "; see pytest.ini): put e.g. "
            "`pytestmark = pytest.mark.unit` in the module, or mark the test itself\n  " + "\n  ".join(problems))
    for item in items:  # a module's tier no longer applies to the tests that chose their own
        for node in item.listchain()[:-1]:
            node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]
    for item, tier in chosen.items():
        item.own_markers[:] = [m for m in item.own_markers if m.name not in TIERS]
        item.add_marker(tier)
