"""What a run serves: the workload, its requests, and conversation suites."""
