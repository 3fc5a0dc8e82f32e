"""The supervisor's loop and what it runs: the loop that alone decides and applies every action
(run.py), the worker table (table.py), each worker's records (worker.py) and environment (env.py),
their output (logs.py), the waits a person watches on a terminal (waits.py), and the checkpoint
folder's lock (folder_lock.py). The components it asks live in ftrun.supervisor.policy, .nodes,
.accounting, and the --ft quorum keeper beside them."""
