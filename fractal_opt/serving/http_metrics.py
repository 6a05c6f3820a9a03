"""Prometheus metrics of ``fractal-opt serve`` (prometheus_client, in the ``serve`` extra).

Every number comes from the tickets' own clock readings (``t_submit``, ``delivered_times``), the
ones the measurement computes TTFT and inter-token latency from, so /metrics and a fractal_opt
report describe the same quantities. Each app gets its own registry, so two servers in one process
(tests) do not share counters.
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["ServeMetrics"]

# Buckets in seconds: TTFT on a CPU spans 10 ms (a cached prompt) to tens of seconds (a long queue).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServeMetrics:
    """Counters, histograms and gauges for one served plan.

    Args:
        server: the request server (its ``queued()`` / ``live()`` / ``in_flight`` / ``max_queue``).
    """

    def __init__(self, server: Any):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fractal_opt_requests", "HTTP requests by endpoint and how they ended", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("fractal_opt_prompt_tokens", "Prompt tokens prefilled (chat template included)", registry=r)
        self.completion_tokens = Counter("fractal_opt_completion_tokens", "Tokens generated", registry=r)
        self.cache_hits = Counter("fractal_opt_response_cache_hits", "Requests the plan's response cache answered", ["kind"], registry=r)
        self.ttft = Histogram("fractal_opt_time_to_first_token_seconds", "Submission to the first token the client could read (queueing included)",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("fractal_opt_inter_token_latency_seconds", "Between consecutive tokens as delivered", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("fractal_opt_e2e_request_latency_seconds", "Submission to the end of the request", buckets=_E2E_BUCKETS, registry=r)
        queue = Gauge("fractal_opt_queue_depth", "Requests waiting for a slot", registry=r)
        queue.set_function(server.queued)
        running = Gauge("fractal_opt_requests_running", "Requests generating now", registry=r)
        running.set_function(lambda: max(0, server.live() - server.queued()))
        Gauge("fractal_opt_queue_limit", "The plan's max_queue (a full queue answers 429)", registry=r).set(server.max_queue)
        Gauge("fractal_opt_in_flight_limit", "Requests the plan runs at once", registry=r).set(server.in_flight)

    def refused(self, endpoint: str, status: str) -> None:
        """A request that never reached the model (bad request, unauthorized, overloaded)."""
        self.requests.labels(endpoint, status).inc()

    def ended(self, endpoint: str, ticket: Any) -> None:
        """Record a ticket that reached its terminal state (call once per ticket)."""
        self.requests.labels(endpoint, ticket.status).inc()
        self.prompt_tokens.inc(ticket.prompt_tokens)
        self.completion_tokens.inc(len(ticket.token_ids))
        if ticket.cache_hit:
            self.cache_hits.labels(ticket.cache_hit).inc()
        times = list(ticket.delivered_times)
        if times:
            self.ttft.observe(max(0.0, times[0] - ticket.t_submit))
            for a, b in itertools.pairwise(times):
                self.itl.observe(max(0.0, b - a))
        if ticket.t_end is not None:
            self.e2e.observe(max(0.0, ticket.t_end - ticket.t_submit))

    def text(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
