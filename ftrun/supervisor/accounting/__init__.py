"""What the supervisor's loop tells: the accounting component (accounts.py: when the state file is
written, from the workers' progress as progress_reader.py reads it and activity.py's samples of
their processes), the goodput books (goodput.py, the accountant; ledger.py, what the loop saw
turned into its events), the state file (status_writer.py), --metrics-port (metrics.py), the
timeline (timeline.py), the checkpoints' lines (checkpoints.py), the words for a worker's end
(report.py) and the waits a person watches on a terminal (waits.py). None of it decides what the
run does, and none of it imports the parts that do (ftrun.supervisor.policy, .loop)."""
