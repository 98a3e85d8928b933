"""Golden sets from live traffic: capture (capture.py, sources.py), the dataset format
(dataset.py), a case's own checks (checks.py), offline replay (replay.py), verdicts per segment
and against a live report (verdicts.py), what is printed (printing.py), the commands (commands.py)."""
