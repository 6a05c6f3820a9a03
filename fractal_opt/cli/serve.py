"""``fractal-opt serve RECIPE_OR_RUN_DIR``: an OpenAI-compatible endpoint on the tuned plan.

It listens on ``--host:--port`` only (the llama.cpp runtime opens no listener of its own; a
llama-server child listens on a loopback port with a key nobody is told). Every connection and
request is bounded (docs/serving.md, "Security and limits"). When the engine says it will never
serve again (a child server that could not be restarted), serve exits with status 1, so a
supervisor starts it afresh.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import socket
import sys
import threading

_LOCAL = ("127.0.0.1", "localhost", "::1")


def add(sub) -> None:
    p = sub.add_parser("serve", help="serve a (tuned) recipe's deployment over an OpenAI-compatible HTTP API")
    p.add_argument("recipe", help="a recipe file, or a run's output folder (its tuned recipe.yaml)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $FRACTAL_OPT_API_KEY, else none)")
    p.add_argument("--model-name", default=None, help="the model id clients see (default: the recipe's name, else its model)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed of the server (default: the recipe's workload seed)")
    p.add_argument("--drain-s", type=float, default=10.0, help="on SIGTERM / Ctrl-C, seconds in-flight requests get to finish before they are cancelled (default 10)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"), help="uvicorn's log level (default info)")
    limits = p.add_argument_group("limits", "bounds on every connection and request (docs/serving.md, 'Security and limits')")
    limits.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body in MiB (default 4; larger: 413)")
    limits.add_argument("--header-timeout-s", type=float, default=10.0, help="a request's line and headers must arrive within this (default 10; then the connection is closed)")
    limits.add_argument("--body-timeout-s", type=float, default=30.0, help="a request's body must arrive within this (default 30; then 408)")
    limits.add_argument("--keep-alive-s", type=float, default=5.0, help="an idle connection between requests is closed after this (default 5)")
    limits.add_argument("--max-connections", type=int, default=1024, help="open connections at once (default 1024; one more: 503)")
    limits.add_argument("--max-tokens-over-cap", choices=("refuse", "honour", "cap"), default="refuse",
                        help="a max_tokens above the plan's cap (its max_new_tokens pass): refuse with a 400 naming the cap (default), honour it, "
                             "or cap it (lowered to the cap, and to the context the prompt leaves, instead of a 400; the answer ends with finish_reason length)")
    limits.add_argument("--timeout-s", type=float, default=None,
                        help="each request's deadline in seconds from its arrival, queueing and generation included; past it the answer ends with "
                             "its tokens so far (default: the plan's, its queue pass's timeout_s; none when the plan sets none)")
    limits.add_argument("--ignore-eos", action="store_true",
                        help="run every answer to its max_tokens, past end-of-sequence (benchmarks with fixed output lengths); requests may send ignore_eos: true")
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    from ..core.errors import RecipeError

    if not 0 < args.port < 65536:
        raise RecipeError(f"serve --port: got {args.port}, expected a port number in 1..65535.")
    if not math.isfinite(args.drain_s) or args.drain_s < 0:
        raise RecipeError(f"serve --drain-s: got {args.drain_s}, expected a finite number of seconds >= 0.")
    if args.timeout_s is not None and (not math.isfinite(args.timeout_s) or args.timeout_s <= 0):
        raise RecipeError(f"serve --timeout-s: got {args.timeout_s}, expected a finite number of seconds > 0.")
    from ..serving.sampling import SEED_MAX, SEED_MIN

    if args.seed is not None and not SEED_MIN <= args.seed <= SEED_MAX:
        raise RecipeError(f"serve --seed: got {args.seed}, expected an integer in [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit integer).")
    limits = _limits(args)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        print(f"fractal-opt: serve needs the 'serve' extra ({e.name} is missing): pip install 'fractal-opt[serve]' (make setup installs it)", file=sys.stderr)
        return 1
    _check_port(args.host, args.port)  # before minutes of loading, not after
    api_key = args.api_key or os.environ.get("FRACTAL_OPT_API_KEY") or None
    if args.host not in _LOCAL and api_key is None:
        print(f"fractal-opt: warning: listening on {args.host} without --api-key: anyone who can reach this port can use the model.", file=sys.stderr)

    from ..language.recipe import load_recipe
    from ..runtimes import Engine, recipe_source
    from ..serving.http import create_app
    from ..serving.http_protocol import uvicorn_options

    _log_to_stderr(args.log_level)
    recipe = load_recipe(recipe_source(args.recipe))
    engine = Engine.from_recipe(recipe, progress=lambda m: print(m, file=sys.stderr))
    plan = engine.plan
    if warning := _busier_than_run(args.recipe, plan):
        print(f"fractal-opt: warning: {warning}", file=sys.stderr, flush=True)
    name = args.model_name or recipe.name or plan.source
    seed = args.seed if args.seed is not None else recipe.workload.seed
    fatal: list[str] = []
    try:
        app = create_app(engine, model_name=name, api_key=api_key, seed=seed, limits=limits, over_cap=args.max_tokens_over_cap,
                         ignore_eos=args.ignore_eos, timeout_s=args.timeout_s, on_fatal=lambda why: (fatal.append(why), setattr(web, "should_exit", True)))
        kept = ", ".join(plan.applied) or "nothing (the baseline)"
        print(f"fractal-opt: serving {name!r} on http://{args.host}:{args.port}/v1 ({plan.hardware.runtime}, {plan.scheduling.batching} batching; "
              f"kept: {kept}). Ctrl-C stops it.", file=sys.stderr, flush=True)
        # uvicorn's own grace period only starts the cancelling; the drain closes the request
        # server first, so every in-flight answer ends as a JSON error / SSE error event.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.drain_s + 10,
                                **uvicorn_options(limits))
        web = _draining_server(config, drain_s=args.drain_s, stop_requests=app.state.server.close)
        stopped = _serve(web)
    finally:
        engine.close()
    if fatal:
        print(f"fractal-opt: serve stopped: the engine cannot serve any more ({fatal[0]}).", file=sys.stderr)
        return 1
    if stopped:
        print(f"fractal-opt: serve stopped ({signal.Signals(stopped).name}).", file=sys.stderr)
    return 0


def _busier_than_run(source: str, plan) -> str | None:
    """The busy-machine warning (:func:`fractal_opt.measure.busier.busier_than_run`) when
    ``source`` is a run folder whose trace.json recorded the load its calibration saw; the load
    now is sampled for one second, this process and its server children left out."""
    import json
    from pathlib import Path

    from ..measure.busier import busier_than_run
    from ..measure.busy import snapshot
    from ..report.trace import Trace

    path = Path(source) / "trace.json"
    if not path.is_file():
        return None
    try:
        trace = Trace.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError):
        return None  # an unreadable trace says nothing about the load; the recipe itself loaded
    threads = plan.hardware.threads if isinstance(plan.hardware.threads, int) else trace.ran_threads()
    return busier_than_run(trace.calibration.get("busy"), snapshot(interval_s=1.0), threads=threads)


def _limits(args: argparse.Namespace):
    """The limit flags as :class:`~fractal_opt.serving.http_limits.HttpLimits`, each checked."""
    from ..core.errors import RecipeError
    from ..serving.http_limits import HttpLimits

    values = {"max_body_mb": args.max_body_mb, "header_timeout_s": args.header_timeout_s, "body_timeout_s": args.body_timeout_s,
              "keep_alive_s": args.keep_alive_s, "max_connections": args.max_connections}
    for name, value in values.items():
        if not math.isfinite(value) or value <= 0:
            raise RecipeError(f"serve --{name.replace('_', '-')}: got {value}, expected a finite number > 0.")
    return HttpLimits(max_body_bytes=int(args.max_body_mb * 2**20), header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                      keep_alive_s=args.keep_alive_s, max_connections=args.max_connections)


def _log_to_stderr(level: str) -> None:
    """fractal_opt's own log lines (a failed request's whole error, a child server's restarts and
    last log lines) to stderr, beside uvicorn's: the operator's view, never the client's."""
    logger = logging.getLogger("fractal_opt")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())


class _Stopped(Exception):
    """The signal uvicorn re-raises once it has shut down gracefully."""


def _serve(server) -> int | None:
    """Run uvicorn until SIGINT / SIGTERM; return the signal that stopped it (None: it stopped itself).

    uvicorn re-raises the signal after its graceful shutdown, which would end the process by
    that signal (or as KeyboardInterrupt); handlers installed here first turn it into a normal
    return, so the engine closes and the exit status is 0.
    """

    def stop(signum, frame):
        raise _Stopped(signum)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    except _Stopped as e:
        return e.args[0]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return None


def _draining_class():
    import uvicorn

    class Draining(uvicorn.Server):
        """uvicorn's server, plus: ``drain_s`` after shutdown starts, the request server closes,
        which cancels what is still queued or running (its clients get a JSON / SSE error)."""

        def __init__(self, config, *, drain_s: float, stop_requests):
            super().__init__(config)
            self.drain_s = drain_s
            self.stop_requests = stop_requests

        async def shutdown(self, sockets=None) -> None:
            loop = asyncio.get_running_loop()
            loop.call_later(self.drain_s, lambda: threading.Thread(target=self._stop_requests, daemon=True).start())
            await super().shutdown(sockets)

        def _stop_requests(self) -> None:
            try:
                self.stop_requests()
            except Exception as e:  # noqa: BLE001 (a worker that will not stop: say so, the exit goes on)
                print(f"fractal-opt: stopping the request server: {e}", file=sys.stderr)

    return Draining


def _draining_server(config, **kwargs):
    return _draining_class()(config, **kwargs)


def _check_port(host: str, port: int) -> None:
    """Refuse a port that is taken, with a message (uvicorn would log and exit after the model loads)."""
    from ..core.errors import RecipeError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise RecipeError(f"serve: cannot listen on {host}:{port}: {e.strerror}. Pick another --port, or stop what holds it.") from None
