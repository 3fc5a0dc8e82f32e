"""The quorum keeper's core: its decisions as pure functions of what it knows (a KeeperSnapshot)
and the time, each returning a decision with its reason, as torchft's quorum_compute does. No
store, no clock, no threads, no logging here: ftrun.supervisor.ft.quorum.QuorumKeeper (the shell)
reads the store into a snapshot, asks, and writes what was decided.

- core: the next quorum (who takes part, who heals and from which replica, from which round,
  rounds of how many steps), the stop quorum, admission of joiners, the run's pace, status views.
- dead: the votes due in the place of members that cannot vote (the dead, and those in another
  quorum), rounds whose closer died, and which keys to collect.
Must never import torch.
"""
