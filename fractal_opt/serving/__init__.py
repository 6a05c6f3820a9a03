"""Serving: the runtime-agnostic request server and ticket, prompt budgets, the response cache, and
the OpenAI-compatible HTTP layer of ``fractal-opt serve`` (http.py, openai_requests.py,
http_metrics.py; http.py needs the ``serve`` extra and is imported only by the CLI)."""
