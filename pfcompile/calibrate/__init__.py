"""Closing the loop from measured runs: read a runtime's measured trace (measured), set it
against its plan per op kind (compare), and fit a profile's entries to it (fit)."""
