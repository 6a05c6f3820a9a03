"""HAProxy in front of replicas: its configuration and its command."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from fractal_opt.runtimes.router import haproxy_config, haproxy_problem, router_command, write_config


def test_the_configuration_balances_by_least_connections_on_loopback():
    """Requests go to the replica with the fewest open connections; each takes at most its slots, the rest queue in HAProxy."""
    text = haproxy_config([("127.0.0.1", 9001), ("127.0.0.1", 9002)], port=9000, maxconn=8)
    assert "bind 127.0.0.1:9000" in text and "balance leastconn" in text
    assert "server r0 127.0.0.1:9001 maxconn 8" in text and "server r1 127.0.0.1:9002 maxconn 8" in text
    assert "timeout server 600s" in text  # a streamed answer may take minutes


def test_the_command_stays_in_the_foreground():
    """-db: HAProxy does not daemonize, so it stays the child its engine stops."""
    assert router_command("/tmp/x.cfg")[1:] == ["-db", "-f", "/tmp/x.cfg"]


def test_missing_haproxy_is_named_with_how_to_install_it(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert "apt-get install haproxy" in haproxy_problem()


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="HAProxy is not installed (apt-get install haproxy; make setup-router)")
def test_haproxy_accepts_the_configuration(tmp_path):
    """HAProxy's own check (-c) accepts what haproxy_config writes."""
    path = write_config(haproxy_config([("127.0.0.1", 9001), ("127.0.0.1", 9002)], port=9000, maxconn=4))
    try:
        run = subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    finally:
        path.unlink()
    assert run.returncode == 0, run.stdout + run.stderr
