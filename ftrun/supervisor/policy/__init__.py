"""What the supervisor's loop does about its workers: the failure policy (failure_policy.py, pure,
with its restart budgets in restart.py), failures into records and actions (failures.py), stopping
(stopping.py), the restarts a peer forced (peer_restarts.py), and which workers are hung (hangs.py,
from the samples of ftrun.supervisor.accounting.activity). Each component returns an action; the
loop (ftrun.supervisor.loop) applies it."""
