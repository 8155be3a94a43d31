"""A burst of clients at once against a real `ds2 serve` (a subprocess, ds2-tiny) that holds few
of them: --queue 4 --parallel 1, so 5 requests at a time and the other 45 are beyond the queue.
Each client gets an answer, 200 or 503 with Retry-After and an OpenAI-style error body: never a
TCP reset, a refused connection or a connection closed without a response."""

import http.client
import json
import threading

from test_serve import KEY, ROMEO, serve_process
import pytest

pytestmark = pytest.mark.slow      # left out of `pytest -m "not slow"` (docs/internals.md, Tests)

CLIENTS = 50
QUEUE, PARALLEL = 4, 1          # `ds2 serve --queue 4 --parallel 1`: 5 held at once, 45 beyond
TIMEOUT_S = 60                  # per connection; a slow machine must not turn into a failure


def one_client(port, start, results, index):
    """A fresh connection once every client is ready; records (status, headers, body) or the error."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    body = json.dumps({"prompt": ROMEO, "max_tokens": 4, "temperature": 0})
    try:
        start.wait(TIMEOUT_S)
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        r = conn.getresponse()
        results[index] = (r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    except Exception as e:     # a reset, a refusal, a closed connection: each is what must not happen
        results[index] = e
    finally:
        conn.close()


def burst(port, clients=CLIENTS):
    """`clients` requests, each on its own connection, all started at once; their results in order."""
    results = [None] * clients
    start = threading.Barrier(clients)
    threads = [threading.Thread(target=one_client, args=(port, start, results, i), daemon=True)
               for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    return results


def test_a_burst_of_50_clients_gets_only_200s_and_503s_with_retry_after():
    with serve_process("--queue", str(QUEUE), "--parallel", str(PARALLEL), "--api-key", KEY) as (proc, port):
        results = burst(port)
        assert proc.poll() is None                  # the server is still up
    log = proc.stderr.read()                        # what it logged until it was killed
    assert "Traceback" not in log and "connection error" not in log
    errors = [r for r in results if not isinstance(r, tuple)]
    assert not errors, f"{len(errors)} of {CLIENTS} clients got no HTTP response: {errors[:5]}"
    statuses = [status for status, _, _ in results]
    print(f"burst of {CLIENTS} clients, --queue {QUEUE} --parallel {PARALLEL}: {statuses.count(200)} x 200, "
          f"{statuses.count(503)} x 503, {len(errors)} without a response")     # shown with pytest -s
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= 1
    for status, headers, body in results:
        if status == 200:
            assert json.loads(body)["usage"]["completion_tokens"] == 4
            continue
        assert headers.get("retry-after") == "1" and headers["content-type"] == "application/json"
        error = json.loads(body)["error"]
        assert error["code"] == "queue_full" and error["type"] and error["message"]
        assert set(error) == {"message", "type", "param", "code"}
