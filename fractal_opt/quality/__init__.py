"""Quality against the baseline: model probes (KL, flips, perplexity, agreement), eval sets and calibration data."""
