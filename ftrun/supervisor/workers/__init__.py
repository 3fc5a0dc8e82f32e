"""The supervisor's worker processes as every part of it sees them: each worker's spec and record
(worker.py), its environment (env.py) and its output (logs.py: per-rank files, the console).
Records and words only: starting, stopping and restarting a worker is the loop's
(ftrun.supervisor.loop)."""
