"""The push app, started once for every module of this package (tests/integration/push/__init__.py)."""

from __future__ import annotations

import time

import pytest

from tests.integration.apps import Client, KvFaultSwitch, running_app
from tests.integration.prometheus import prometheus_scraping
from tests.integration.push import CONFIG
from tests.observability import RULES as ALERT_RULES


@pytest.fixture(scope="package")
def client(log_dir):
    """The app, and a real Prometheus scraping it from the start (with the alert rules loaded). The app
    can be told to corrupt pushed KV (connector.kv_checksum): ``client.kv_fault`` is the switch. At the
    end, the mismatches counted are exactly the ones injected: clean traffic raised no false alarm."""
    switch = KvFaultSwitch(log_dir / "kv-fault")
    with running_app(CONFIG, log_dir, how="make", env=switch.env) as app, \
            prometheus_scraping(app.metrics_url(), log_dir / "prometheus-push", (ALERT_RULES,)) as prometheus:
        client = switch.attach(Client(app))
        client.prometheus = prometheus
        client.expiries_logged_by = 0.0  # monotonic time by which a leaked lease of the tests so far is in the log
        yield client
        client.http.close()
        switch.assert_only_injected_mismatches(client)
        # A prefill leg whose KV no decode took (a body decode refused, a leg nobody aborted) holds it until its
        # lease runs out, and vLLM logs the release then: checked once for the whole package, after the fuzz
        # test's lease has run out (the tests after it pass most of that time).
        time.sleep(max(0.0, client.expiries_logged_by - time.monotonic()))
        with app.log_path.open(errors="replace") as log:
            expired = [line[-220:] for line in log if "Releasing expired KV blocks" in line]
        assert not expired, f"prefill KV that no decode took: {expired}"
