"""The supervisor's loop: the one place that decides and applies every action (run.py), the worker
table it alone keeps (table.py), what is built before it starts (start.py), and the checkpoint
folder's lock it takes first (folder_lock.py), and a c10d run's rounds of it (c10d.py).
The components it asks live in ftrun.supervisor.policy, .nodes, .accounting and the --ft quorum
keeper; they read ftrun.supervisor.workers and never import the loop."""
