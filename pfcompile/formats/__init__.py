"""The contract between compiler and runtime: the op vocabulary, the profile and plan
formats, the trace format, JSON I/O and the one user-facing error type.

Imports neither torch nor ortools, networkx or graphviz (tests/test_boundaries.py): the
runtime imports this package of pfcompile and nothing else.
"""
