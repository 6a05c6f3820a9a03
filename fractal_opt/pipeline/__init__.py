"""The runner: baseline, then each pass measured and judged; the trace and its reports."""
