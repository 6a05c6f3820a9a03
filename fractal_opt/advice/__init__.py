"""Advice: the commands that read a situation before changing it.

- :mod:`.doctor`: the troubleshooting checklist as checks, each with a verdict and what to do.
- :mod:`.bisect`: which kept pass makes a tuned plan slower on a new workload, by rolling back halves.
- :mod:`.compare`: two run folders or recipes side by side, optionally re-measured interleaved.
- :mod:`.suggest`: a short baseline, its bottleneck per phase, and a recipe of the passes that attack it.

They sit beside :mod:`fractal_opt.pipeline` (they build engines through ``runtimes.build`` and
measure with :mod:`fractal_opt.measure`); the CLI modules in :mod:`fractal_opt.cli` call them.
"""
