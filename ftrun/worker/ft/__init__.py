"""Replica fault tolerance inside a worker: membership quorums, votes, healing.

Used through the public API in ``ftrun.ft``. Never imports the supervisor.
"""
