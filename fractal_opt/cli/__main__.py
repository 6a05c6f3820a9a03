"""``python -m fractal_opt.cli``: the ``fractal-opt`` command."""

import sys

from . import main

sys.exit(main())
