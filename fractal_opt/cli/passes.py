"""``fractal-opt passes``: every pass by layer, its parameters, and whether it can run here."""

from __future__ import annotations

import argparse
import dataclasses
import typing


def add(sub) -> None:
    p = sub.add_parser("passes", help="list every pass by layer")
    p.set_defaults(func=passes)


def passes(args: argparse.Namespace) -> int:
    from ..layers import passes_by_layer
    from ..machine import Machine
    from ..validate import type_name

    machine = Machine.probe()
    for layer, classes in passes_by_layer().items():
        print(f"{layer.value}. {layer.section}")
        for cls in classes:
            hints = typing.get_type_hints(cls)
            params = ", ".join(f"{f.name}: {type_name(hints[f.name])} = {f.default!r}" for f in dataclasses.fields(cls))
            why = cls().unavailable(machine)
            here = "available on this machine" if why is None else f"not available here: {why}"
            print(f"   {cls.name:<16} {cls.summary()}")
            print(f"   {'':<16} params: {params or '-'}")
            print(f"   {'':<16} {here}")
            if cls.name == "runtime":
                from ..runtimes import availability

                for runtime, reason in availability(machine).items():
                    print(f"   {'':<16}   {runtime:<13} {'runs here' if reason is None else 'not here: ' + reason}")
    return 0
