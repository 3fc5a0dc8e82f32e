"""A deterministic simulator of --ft: the real keeper, member and vote code, run over an
in-memory store, simulated process groups and a virtual clock, under seeded schedules of
faults, with the protocol's invariants checked after every event (scripts/simulate.py).
Must never be imported by the product: it exists for tests and the simulate script.
"""
