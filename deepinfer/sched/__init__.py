"""Scheduling: token budget, admission, running set, preemption."""
