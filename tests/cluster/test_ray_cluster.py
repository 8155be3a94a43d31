"""Joining a cluster (cluster/ray_cluster.py) when what listens at the address is no Ray GCS: a
listener that accepts and says nothing, one that answers garbage, one that hangs up. Each is one
error within the connect bound, before ray.init (which would wait with no end). The listeners run
in this process on 127.0.0.1; the command's run is bounded by a generous timeout, never timed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from ds2cli.cluster.ray_cluster import CONNECT_TIMEOUT_S, ClusterError, is_settings_frame, reachable

# what a gRPC server sends first: a SETTINGS frame on stream 0 (here empty)
SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


class Listener:
    """A TCP listener on 127.0.0.1 that answers each connection by `answer(conn)`."""

    def __init__(self, answer):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer, self.conns = answer, []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def silent(conn) -> None:
    pass


def garbage(conn) -> None:
    try:
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 4)
    except OSError:
        pass


def hang_up(conn) -> None:
    conn.close()


def grpc_like(conn) -> None:
    conn.sendall(SETTINGS)


@pytest.fixture
def listener():
    made = []

    def make(answer) -> Listener:
        made.append(Listener(answer))
        return made[-1]
    yield make
    for lst in made:
        lst.close()


def test_a_settings_frame_is_what_a_gcs_answers():
    assert is_settings_frame(SETTINGS)
    assert not is_settings_frame(bytes([0, 0, 0, 4, 1, 0, 0, 0, 0]))       # an acknowledgement
    assert not is_settings_frame(bytes([0, 0, 0, 4, 0, 0, 0, 0, 1]))       # not stream 0
    assert not is_settings_frame(b"HTTP/1.1 ")
    assert not is_settings_frame(b"")


@pytest.mark.parametrize("answer, says", [(silent, "did not answer as a Ray GCS within 0.3 s"),
                                          (garbage, "answered, but not as a Ray GCS"),
                                          (hang_up, "closed the connection without answering as a Ray GCS")],
                         ids=["silent", "garbage", "hang-up"])
def test_a_listener_that_is_no_gcs_is_one_error(listener, answer, says):
    at = listener(answer)
    with pytest.raises(ClusterError, match=says):
        reachable(at.address, timeout=0.3)


def test_a_server_that_opens_as_grpc_does_passes(listener):
    reachable(listener(grpc_like).address, timeout=5)


def test_nothing_listening_is_one_error():
    with socket.create_server(("127.0.0.1", 0)) as s:
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ClusterError, match="cannot reach a Ray cluster at"):
        reachable(address, timeout=1)


@pytest.mark.slow
@pytest.mark.parametrize("answer", [silent, garbage], ids=["silent", "garbage"])
def test_generate_against_a_listener_that_is_no_gcs_ends_in_one_error_line(listener, answer):
    """The command, with the bound Ray's own setting gives (2 s here; 10 s, CONNECT_TIMEOUT_S,
    by default): one error line, exit 1, within a margin."""
    pytest.importorskip("ray")
    at = listener(answer)
    bound = 2
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ds2cli", "generate", "--ray", at.address, "-n", "3", "hi"],
                       capture_output=True, text=True, timeout=CONNECT_TIMEOUT_S + 30,
                       env={**os.environ, "RAY_gcs_server_port_wait_time_s": str(bound)})
    took = time.monotonic() - t0
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {at.address} "), r.stderr
    if answer is silent:
        assert f"within {bound} s" in r.stderr or f"within {bound}.0 s" in r.stderr, r.stderr
    assert took < bound + 5, took      # the bound, and the start of Python and Ray
