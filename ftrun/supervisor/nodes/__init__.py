"""Several machines, one run: the node coordinator (coordinator.py), an event source for the loop,
with its parts as functions that return what they found (node_join.py, node_restart.py,
node_common.py), the store's moves decided from a view (node_moves.py) and its watch thread
(node_watch.py); what the loop does on a
node's news (node_decisions.py); the store's election (failover.py); the parts of the c10d
rendezvous (rendezvous.py, one round in rendezvous_rounds.py, and the word left at its endpoint
once the store moved: redirect.py), whose rounds the loop runs (loop/c10d.py)."""
