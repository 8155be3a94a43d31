"""The events of a streamed OpenAI-style response (server-sent events), for the clients the
healing test and bench/cluster_heal.py run in a cluster's network namespace."""

import json


def events(response):
    """Each `data:` event's JSON, in order, up to `data: [DONE]`; other lines skipped."""
    for line in response:
        line = line.decode().strip()
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line[6:])
