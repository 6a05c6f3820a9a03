"""Serving: the runtime-agnostic request server and ticket, prompt budgets and the response cache."""
