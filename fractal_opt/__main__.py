"""``python -m fractal_opt``: the ``fractal-opt`` command."""

import sys

from .cli import main

sys.exit(main())
