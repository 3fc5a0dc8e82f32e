"""What the supervisor's loop tells: the accounting component (accounts.py: when the state file is
written, from the workers' progress as progress_reader.py reads it), the goodput books (goodput.py,
the accountant; ledger.py, what the loop saw turned into its events), the state file (status_writer.py),
--metrics-port (metrics.py), the timeline (timeline.py), the checkpoints' lines (checkpoints.py) and
the words for a worker's end (report.py). None of it decides what the run does."""
