"""Fault injection: the real stack under upstream, broker, process and client faults (issue 8)."""
