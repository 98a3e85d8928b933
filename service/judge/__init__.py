"""The judge: anytime-valid, per-segment comparisons of candidate and stable (DESIGN §9).

stats.py     the statistics (numpy/scipy only)
tests.py     the judge-test extension point (one Protocol, implementations side by side)
catalog.py   which comparisons a route makes, margins, the alpha split
evidence.py  sufficient statistics per window, source, arm and segment
decide.py    the rules → LastDecision with reasons and evidence; /analysis
"""
