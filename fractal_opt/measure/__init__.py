"""Measurement: every timing rule, the one runner, load profiles, noise, memory, machine limits, roofline, budget and pre-flight. Importing it loads no torch."""
