"""--ft on the supervisor's side: the quorum keeper's shell (quorum.py: it reads the store into a
snapshot, asks the core and writes the decision), its parts (quorum_status.py: the replicas'
reports; quorum_votes.py: the votes as cast), its core without IO (keeper/: the next quorum, votes
for the dead, the pace, the keys collected), and what the loop takes from it each tick
(quorum_view.py)."""
