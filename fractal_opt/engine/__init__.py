"""What the rest of the house may ask of a loaded deployment: :mod:`fractal_opt.engine.protocol`."""
