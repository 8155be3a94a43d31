"""The session's Ray cluster for the tests of this folder (ray_local.py says how it is made)."""

import pytest

from ray_local import Cluster, usable


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Two nodes (the head and a worker) on 127.0.0.1 inside a private network namespace."""
    why = usable()
    if why:
        pytest.skip(why)
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start_head()
        c.own.append(c.add_node())
        c.nodes.clear()           # the session's own worker stays until stop: tests add their own
        yield c
    finally:
        c.stop()
