"""A worker pool runs many jobs in the same processes (the suite's session pools, a library caller's): each
job must leave them as it found them."""

from __future__ import annotations

import sys

import pytest

from tests import dist_jobs


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts descriptors in /proc")
def test_jobs_leave_no_process_groups_behind(pools):
    """Each job's meshes make gloo groups (sockets, pipes, an event loop: about ten descriptors a rank).
    Left open, a few hundred jobs took a worker past 1,024 descriptors, where select() fails; and a
    mesh of the same shape in a later job must not be handed the destroyed groups of an earlier one
    (DTensor caches sharding results under meshes that compare equal by shape)."""
    runs = [pools(4).run(dist_jobs.mesh_job) for _ in range(4)]
    for ranks in runs:
        assert [total for _, total in ranks] == [[0.0, 2.0, 4.0, 6.0]] * 4
    opened = [[fds for fds, _ in ranks] for ranks in runs]
    assert opened[1] == opened[2] == opened[3], opened
