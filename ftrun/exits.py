"""ftrun's exit statuses, those its workers and nodes pass to each other, and its own signal.

A status is a constant named here, never a bare number at an exit, and the exit-codes reference
page is generated from EXIT_STATUSES (scripts/docs_reference.py). Declarations only: must never
import torch nor anything of ftrun's (the command line's path imports it).
"""

from __future__ import annotations

import signal
from typing import NamedTuple, Tuple

# ftrun's own exit status, and the statuses its workers and nodes pass to each other. Where a
# worker failed for good, ftrun exits with that worker's status instead (128 + N for signal N).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
# A --ft worker that must not go on with the state it holds (its round was decided otherwise, it
# lost the run's store for good, a heal it took part in failed): its supervisor restarts it as
# any failed replica, and it heals from a peer (sysexits' EX_TEMPFAIL).
EXIT_REPLICA_RESTART = 75
# A worker's exit status when the run cannot go on as started, whatever is restarted: the
# checkpoint it must resume from holds another model or optimizer, or the script misuses
# ftrun.ft (sysexits' EX_CONFIG). Its last "ftrun.ft: " line says why; the supervisor ends the
# run with that line (exit 2).
EXIT_CANNOT_GO_ON = 78
EXIT_SIGNAL_BASE = 128                                   # + N: ended by signal N, as a shell reports it
EXIT_SIGINT = EXIT_SIGNAL_BASE + int(signal.SIGINT)      # 130: Ctrl-C
EXIT_SIGTERM = EXIT_SIGNAL_BASE + int(signal.SIGTERM)    # 143
# --ft, the run cannot go on here (node 0 of two lost, or too few nodes left for the store to
# move): every other node stops and exits with this, for a scheduler to requeue the job, which
# resumes from --checkpoint-dir (>= 128: Kubeflow's restartPolicy ExitCode retries it; Slurm and
# Kubernetes Jobs can key on it).
EXIT_REQUEUE = 200


class ExitStatus(NamedTuple):
    code: str       # the status, or a rule such as "128 + N"
    name: str       # the constant that holds it
    who: str        # "ftrun" (the launcher's own status) or "worker" (between a worker and its ftrun)
    meaning: str


EXIT_STATUSES: Tuple[ExitStatus, ...] = (
    ExitStatus(str(EXIT_OK), "EXIT_OK", "ftrun", "Every worker finished with 0 (under --ft: every replica's "
               "last process; a replica given up, or a failure after the training loop, is not 0)."),
    ExitStatus(str(EXIT_FAILED), "EXIT_FAILED", "ftrun", "The run failed: a worker failed without an exit status "
               "of its own to pass on, the zygote died, a node was lost on a run that needs every node, or a "
               "c10d run could not re-form."),
    ExitStatus(str(EXIT_USAGE), "EXIT_USAGE", "ftrun", "Bad input: one line naming the problem and the fix, nothing "
               "started. Also a run that cannot form (a node rank taken twice, nodes that never came, node 0 "
               "unreachable) and a checkpoint written by another model or optimizer."),
    ExitStatus("N", "-", "ftrun", "The status N of the worker that failed first, once the restart budget is "
               "spent; under --ft also once the others finished without it, or when it failed after the loop."),
    ExitStatus(f"{EXIT_SIGNAL_BASE} + N", "EXIT_SIGNAL_BASE", "ftrun", "The first failed worker was killed by "
               "signal N, or ftrun itself was (137: SIGKILL sent from outside; the OOM killer only on evidence)."),
    ExitStatus(str(EXIT_SIGINT), "EXIT_SIGINT", "ftrun", "Stopped by Ctrl-C (SIGINT): the workers got it and the "
               "grace of --shutdown-timeout (--ft with --checkpoint-dir: after a checkpoint of the last committed "
               "step, within that grace)."),
    ExitStatus(str(EXIT_SIGTERM), "EXIT_SIGTERM", "ftrun", "Stopped by SIGTERM (a scheduler's cancel or "
               "pre-emption), after the same grace (and the same checkpoint first)."),
    ExitStatus(str(EXIT_REQUEUE), "EXIT_REQUEUE", "ftrun", "--ft, several nodes: the run's store was lost and "
               "could not move (two nodes, or half of the nodes lost). Nothing to fix: requeue the job; it "
               "resumes from --checkpoint-dir."),
    ExitStatus(str(EXIT_REPLICA_RESTART), "EXIT_REPLICA_RESTART", "worker", "A --ft worker that must not go on "
               "with the state it holds (a round decided against what it did, a failed heal, the run's store "
               "lost for good) exits so: its ftrun restarts the replica, which heals from a peer."),
    ExitStatus(str(EXIT_CANNOT_GO_ON), "EXIT_CANNOT_GO_ON", "worker", "The run cannot go on as started, "
               "whatever is restarted: the checkpoint a worker must resume from holds another model or optimizer, "
               "or the script misuses ftrun.ft (opt.step() outside ft.steps()/ft.epochs(), an ft.DataLoader it "
               "cannot serve), or the guard found replicas whose states differ with no majority to heal from. The "
               "worker says why in one line; its ftrun ends the run at once with exit 2."),
)


# A realtime signal nobody else uses (SIGUSR1/2 belong to user code: Lightning, SLURM requeue):
# a worker dumps its Python stacks to its log when it gets it.
DUMP_STACKS_SIGNAL = signal.SIGRTMIN + 7
