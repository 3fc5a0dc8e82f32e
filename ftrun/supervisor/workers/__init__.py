"""The supervisor's worker processes as every part of it sees them: each worker's spec and record
(worker.py), its environment (env.py), its output (logs.py: per-rank files, the console) and
the spawners that start it and report its exit (spawn.py).
None of it decides when a worker starts, stops or restarts: the loop does
(ftrun.supervisor.loop)."""
