"""``fractal-opt serve RECIPE_OR_RUN_DIR``: an OpenAI-compatible endpoint on the tuned plan."""

from __future__ import annotations

import argparse
import asyncio
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
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    from ..errors import RecipeError

    if not 0 < args.port < 65536:
        raise RecipeError(f"serve --port: got {args.port}, expected a port number in 1..65535.")
    if args.drain_s < 0:
        raise RecipeError(f"serve --drain-s: got {args.drain_s}, expected seconds >= 0.")
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

    from ..recipe import load_recipe
    from ..runtimes import Engine, recipe_source
    from ..serving.http import create_app

    recipe = load_recipe(recipe_source(args.recipe))
    engine = Engine.from_recipe(recipe, progress=lambda m: print(m, file=sys.stderr))
    plan = engine.plan
    name = args.model_name or recipe.name or plan.source
    seed = args.seed if args.seed is not None else recipe.workload.seed
    try:
        app = create_app(engine, model_name=name, api_key=api_key, seed=seed)
        kept = ", ".join(plan.applied) or "nothing (the baseline)"
        print(f"fractal-opt: serving {name!r} on http://{args.host}:{args.port}/v1 ({plan.hardware.runtime}, {plan.scheduling.batching} batching; "
              f"kept: {kept}). Ctrl-C stops it.", file=sys.stderr, flush=True)
        # uvicorn's own grace period only starts the cancelling; the drain closes the request
        # server first, so every in-flight answer ends as a JSON error / SSE error event.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.drain_s + 10)
        stopped = _serve(_draining_server(config, drain_s=args.drain_s, stop_requests=app.state.server.close))
    finally:
        engine.close()
    if stopped:
        print(f"fractal-opt: serve stopped ({signal.Signals(stopped).name}).", file=sys.stderr)
    return 0


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
    from ..errors import RecipeError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise RecipeError(f"serve: cannot listen on {host}:{port}: {e.strerror}. Pick another --port, or stop what holds it.") from None
