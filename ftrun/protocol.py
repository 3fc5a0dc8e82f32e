"""Every store key and payload that ftrun's processes share: the one vocabulary of the house.

Supervisors (one per node) and workers talk only through the run's TCPStore
(and, for bulk data, process groups). Every key any of them writes or reads
is named here, with what its value holds, so the two sides cannot drift
apart and a key's meaning is in one place. Must never import torch (the
supervisor imports it on its torch-free path) nor anything of ftrun's.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from typing import List, Mapping, NamedTuple, Optional, Tuple

# ---------------------------------------------------------------- workers -> supervisor: progress
# A ftrun.wire.ProgressReport (its codec holds the fields), rewritten by every worker's
# heartbeat thread every HEARTBEAT_S (ftrun/worker/progress.py). In the run's
# store, or in the worker's node's store when its node relays (node_info_key).
HEARTBEAT_S = 0.25


def progress_key(rank: int) -> str:
    return f"ftrun/progress/{rank}"


# A realtime signal nobody else uses (SIGUSR1/2 belong to user code: Lightning, SLURM requeue):
# a worker dumps its Python stacks to its log when it gets it.
DUMP_STACKS_SIGNAL = signal.SIGRTMIN + 7

# ---------------------------------------------------------------- supervisors of several nodes
class NodeKeys:
    """The keys the supervisors of several nodes agree through, under rendezvous round `rnd`
    (a c10d run re-forms in rounds, whose nodes must never read an earlier round's claims,
    beats or failures)."""

    def __init__(self, rnd: int = 0) -> None:
        self.prefix = f"ftrun/nodes/r{rnd}/" if rnd else "ftrun/nodes/"
        self.layout = self.prefix + "layout"       # the job's node layout once formed

    def claim(self, k: int) -> str:
        return f"{self.prefix}claim/{k}"          # counter: how many ftruns claimed node rank k

    def who(self, k: int) -> str:
        return f"{self.prefix}who/{k}"            # host and pid of node k's ftrun

    def beat(self, k: int) -> str:
        return f"{self.prefix}beat/{k}"           # counter bumped by node k every beat

    def final(self, k: int) -> str:
        return f"{self.prefix}final/{k}"          # node k's exit status, once it ended

    def table(self, k: int) -> str:
        return f"{self.prefix}table/{k}"          # node k's replica table (JSON) for `ftrun status`

    def fail(self, attempt: int) -> str:
        return f"{self.prefix}fail/{attempt}"     # first failure of a group attempt (JSON; compare_set)

    def stopped(self, attempt: int) -> str:
        return f"{self.prefix}stopped/{attempt}"  # counter: nodes that stopped their workers after it

    def go(self, attempt: int) -> str:
        return f"{self.prefix}go/{attempt}"       # node 0's word that attempt+1 may start

    def report0(self, attempt: int) -> str:
        # rank 0's last progress report of a stopped attempt, copied by node 0 before attempt+1
        # starts (the new rank 0 overwrites its progress key at once): where its script saved
        return f"{self.prefix}report0/{attempt}"

    def standby(self, k: int) -> str:
        return f"{self.prefix}standby/{k}"        # host:port of node k's standby store (--ft; nodes >= 1)

    @property
    def live(self) -> str:
        # JSON list of the node ranks in the run, as node 0 sees it; under --ft on an elastic
        # c10d run it grows when node 0 admits a late node and shrinks when one is lost.
        return self.prefix + "live"


# ---------------------------------------------------------------- the store moves (--ft, several nodes)
# Each node but node 0 hosts a standby store from the start (ftrun/supervisor/nodes/failover.py). When
# the run's store is lost, the survivors agree on the next host in generation g through keys in
# the candidates' standby stores; the host's standby store becomes the run's store.
def failover_node(gen: int, k: int) -> str:
    return f"ftrun/failover/{gen}/node/{k}"  # node k chose this candidate in generation gen


def failover_formed(gen: int) -> str:
    return f"ftrun/failover/{gen}/formed"    # JSON {"host", "nodes"}: the new layout, once agreed


# In each node's standby store, for that node's own workers: "<gen> <host>:<port>" of the run's
# store; a worker that loses the run's store waits here for the next one (ftrun/worker/ft/manager.py).
RUN_STORE = "ftrun/run-store"


RDZV = "ftrun/rdzv/"                     # c10d rendezvous (ftrun/supervisor/nodes/rendezvous.py)


def rdzv_arrivals(rnd: int) -> str:
    return f"{RDZV}{rnd}/arrivals"       # counter: a joining node's arrival index is its node rank


def rdzv_admit(rnd: int, node: int) -> str:
    return f"{RDZV}{rnd}/admit/{node}"   # --ft: node 0 took late node `node` into running round `rnd`


RDZV_RUN = RDZV + "run"       # the run id, set by the node hosting the endpoint as it binds
RDZV_MOVED = RDZV + "moved"   # host:port of the run's store now, left at the original endpoint
RDZV_HOST = RDZV + "host"     # "<node> <gen>": the node hosting a moved store, and its generation

# ---------------------------------------------------------------- --ft: the round protocol
# Each member (ft/manager.py) is in one phase at a time, reported in its info key; what it
# waits for, and what ends the wait:
#   join     join_key = its incarnation; polls LATEST and the quorums for the newest one that
#            lists it and has begun (start_round, or start_key). A deleted quorum ends the scan.
#            Ends when such a quorum exists (or FINISHED).
#   group    builds the quorum's group under pg_prefix(quorum, round): given up the moment a
#            member's inc_key says "dead", else after FTRUN_FT_TIMEOUT (10 s).
#   heal     the state travels from the source to its healers over a group of those ends
#            (FTRUN_FT_TIMEOUT per chunk; a dead end fails it at once).
#   compute  the script's forward and backward; collectives bounded by FTRUN_FT_TIMEOUT
#            (NCCL: the vote first waits for the stream at most that long). Before the
#            round's first collective the member reads the previous round's decision
#            (see "commit"), in the "vote" phase while it waits.
#   vote     a round is Quorum.round_steps steps (fewer where a checkpoint or the loop's end
#            falls: the same count on every member), one vote for them all. A member steps
#            at once after each step whose collectives succeeded; after the round's last it
#            adds OK_VOTE to count_key(quorum, round) from a thread of its own. One whose
#            collective fails in the round's step P lowers kept_key to P (the steps it has
#            taken), adds FAIL_VOTE and waits for the decision. The add that completes the count
#            writes decision_key; a member reads it when it needs it (FTRUN_FT_VOTE_TIMEOUT,
#            600 s). The wait ends when every member voted, or when the keeper votes in a
#            member's place: ABSTAIN_VOTE for a dead one (every round its peers may be in),
#            FAIL_VOTE after STUCK_S for one that reports another quorum, or that is still
#            joining while a newer quorum is out (it will enter that one, never this).
#   commit / discard: a failed round keeps its first P steps, the lowest P voted. A member
#            that took another count of the round's steps exits and restarts as a healer (a
#            mixed outcome, when a peer dies mid-collective, or a dead member's own vote and
#            its abstention both counted). The others switch
#            to the decision's quorum: after a failed round at the next round (everyone who
#            goes on waited for that decision); after a commit at the round after next (the
#            first boundary every member reaches having read it).
#            In a quorum with start_round every member begins there; otherwise the first
#            member to enter writes its round into start_key and every other member and
#            joiner begins at that round.
# The keeper (supervisor/ft/quorum.py, node 0) publishes a quorum when a replica dies or asks
# to join; one that starts from nothing (the first, or after every replica was lost) waits
# up to 30 s for every replica being started.
PREFIX = "ftrun/ft/"
LATEST = PREFIX + "latest"            # id of the newest published quorum
FINISHED = PREFIX + "finished"        # set by members that left the loop: the final global step


def quorum_key(quorum: int) -> str:
    return f"{PREFIX}quorum/{quorum}"  # JSON Quorum, immutable once written


def start_key(quorum: int) -> str:
    return f"{PREFIX}start/{quorum}"   # round at which members switched to the quorum


# A round's votes are one counter per (quorum, round): each member adds OK_VOTE or FAIL_VOTE; the
# supervisor adds ABSTAIN_VOTE for a member it saw die (had it finished the round's collectives, its
# peers' succeeded too) and FAIL_VOTE for a live member that will never vote there. The add that
# takes the count to the quorum's size (or past it: closes) writes the decision (commit: no failed
# vote, one ok at least); the others read it. Each field has 21 bits: 2M votes of a kind per round.
OK_VOTE = 1
ABSTAIN_VOTE = 1 << 21
FAIL_VOTE = 1 << 42
TOP = PREFIX + "top"                  # the newest round whose decision was written (a hint for the keeper)


def count_key(quorum: int, round_: int) -> str:
    return f"{PREFIX}n/{quorum}/{round_}"


def decision_key(quorum: int, round_: int) -> str:
    # "commit E" / "fail E" / "fail E P": E = the newest quorum its author had seen; P = how many of
    # the round's steps stand (kept_key), 0 when absent.
    return f"{PREFIX}d/{quorum}/{round_}"


# Steps per round, read by the keeper and published in every quorum: one vote, and one store
# round trip per member, for this many steps. Eight keep a 7 ms step's vote under 1% of it and a
# join or a switch within a few rounds; a failure costs no more steps than with one (kept_key).
ROUND_STEPS = 8
ROUND_STEPS_ENV = "FTRUN_FT_ROUND_STEPS"
# Unless FTRUN_FT_ROUND_STEPS is set, a quorum published once the keeper has seen the run's pace has
# rounds of about this long (ROUND_STEPS steps at most): a restarted replica joins at a round's top,
# and 21M-parameter steps of 0.3 s in rounds of eight kept it waiting up to 2.4 s (measured: back in
# 2.5-3.0 s after half the kills). One vote per 0.2 s stays far under 1% of the time.
ROUND_TARGET_S = 0.2


def round_steps_for(step_s: Optional[float], most: int) -> int:
    """Steps per round for a run whose steps take `step_s` (None: not known yet): `most`, or
    fewer so that a round lasts about ROUND_TARGET_S (to the nearest step); one at least."""
    if step_s is None or not step_s > 0:
        return most
    return max(1, min(most, int(ROUND_TARGET_S / step_s + 0.5)))


def round_steps_from_env(env: Mapping[str, str]) -> Tuple[int, Optional[str]]:
    """(steps per round, a line saying why the environment's value was not taken, or None)."""
    raw = env.get(ROUND_STEPS_ENV)
    if raw is None:
        return ROUND_STEPS, None
    if raw.strip().isdigit() and 1 <= int(raw) <= 1024:
        return int(raw), None
    return ROUND_STEPS, (f"{ROUND_STEPS_ENV}={raw!r} is not a whole number of steps from 1 to 1024; fix it or "
                         f"unset {ROUND_STEPS_ENV} (default {ROUND_STEPS})")


# The guard (worker/ft/heal/agreement.py): the quorum's members compare a fingerprint of their whole
# state at a round's top after a heal's first round, and every CHECK_S seconds of training at the
# run's pace (Quorum.check_steps, sized by the keeper). FTRUN_FT_CHECK_S=0 turns it off.
CHECK_S = 300.0
CHECK_S_ENV = "FTRUN_FT_CHECK_S"
# Steps between checks while the run's pace is not known (a sharded replica's quorums are not re-paced).
CHECK_STEPS_UNPACED = 1000


def check_s_from_env(env: Mapping[str, str]) -> Tuple[float, Optional[str]]:
    """(seconds between the guard's checks, 0 for none; a line saying why the environment's value
    was not taken, or None). Read alike by the keeper and every member."""
    raw = env.get(CHECK_S_ENV)
    if raw is None:
        return CHECK_S, None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value >= 0 and value == value and value != float("inf"):
        return value, None
    return CHECK_S, (f"{CHECK_S_ENV}={raw!r} is not a number of seconds (0 or more); fix it or unset {CHECK_S_ENV} "
                     f"(default {CHECK_S:g})")


CHECK_STEPS_ENV = "FTRUN_FT_CHECK_STEPS"


def check_steps_from_env(env: Mapping[str, str]) -> Tuple[Optional[int], Optional[str]]:
    """(steps between the guard's checks the user chose, or None; a line saying why the
    environment's value was not taken, or None)."""
    raw = env.get(CHECK_STEPS_ENV)
    if raw is None:
        return None, None
    if raw.strip().isdigit() and int(raw) >= 1:
        return int(raw), None
    return None, (f"{CHECK_STEPS_ENV}={raw!r} is not a whole number of steps (1 or more); fix it or unset "
                  f"{CHECK_STEPS_ENV} (unset: about every {CHECK_S_ENV} seconds)")


def check_steps_for(step_s: Optional[float], check_s: float) -> int:
    """Steps between the guard's checks for a run whose steps take `step_s` (None: not known yet):
    about `check_s` seconds of them, one at least; 0 (none) when the guard is off."""
    if check_s <= 0:
        return 0
    if step_s is None or not step_s > 0:
        return CHECK_STEPS_UNPACED
    return max(1, int(check_s / step_s + 0.5))


# A round is up to FTRUN_FT_ROUND_STEPS steps (one vote for them all); a member whose collective
# fails in the round's step P (counted from 0) has taken P of its steps and votes fail, after
# lowering kept_key to P. The round's decision keeps the lowest P: its first P steps succeeded for
# every member, so members holding exactly P steps go on and any member holding more restarts.
def kept_key(quorum: int, round_: int) -> str:
    return f"{PREFIX}p/{quorum}/{round_}"


def read_kept(store, quorum: int, rnd: int) -> int:
    """The steps of a failed round that stand: none unless a failed member said otherwise."""
    key = kept_key(quorum, rnd)
    return int(store.get(key)) if store.check([key]) else 0


def decision_text(commit: bool, quorum: int, kept: int = 0) -> str:
    return f"commit {quorum}" if commit else (f"fail {quorum} {kept}" if kept else f"fail {quorum}")


def parse_decision(text: str) -> Tuple[bool, int, Optional[int]]:
    """(commit, newest quorum its author had seen, steps kept: None for all of them)."""
    parts = text.split()
    commit = parts[0] == "commit"
    return commit, int(parts[1]), None if commit else (int(parts[2]) if len(parts) > 2 else 0)


class Tally(NamedTuple):
    votes: int
    fails: int
    oks: int

    @property
    def commit(self) -> bool:
        """The round's decision once closed: every vote that was cast ok or abstained, one ok at least."""
        return self.fails == 0 and self.oks > 0


def tally(total: int) -> Tally:
    """What a round's counter holds."""
    total = int(total)
    fails, rest = divmod(total, FAIL_VOTE)
    abstains, oks = divmod(rest, ABSTAIN_VOTE)
    return Tally(oks + abstains + fails, fails, oks)


def closes(total: int, added: int, size: int) -> bool:
    """Whether the add of `added` that left a counter at `total` took it from below `size` to
    `size` or past it. Exactly one add does. Past: the keeper's vote for a stopped member that
    then voted too, before a node's forward of several votes (== size would never close it)."""
    return tally(int(total) - int(added)).votes < size <= tally(total).votes


# Votes through a node's relay (--ft on several nodes): a node's workers vote in their node's own
# store (its standby store, FTRUN_NODE_STORE; the run's store on the node hosting it), and the run's
# store sees one vote per node and round. The add that completes node_count_key (the quorum's members
# on that node) makes its author the node's forwarder: it adds the node's whole count to count_key
# (the fields add up), then copies the round's decision into node_decision_key for the node's other
# members. The keeper's votes for a dead or absent member go to its node's counter while that store
# answers (an add of the keeper's that completes it forwards), to count_key once the node is lost.
# node_forwarded_key: the node's count reached count_key (else the keeper forwards a completed count
# whose forwarder died). NODE_LOST_DECISION, written by the node's ftrun after the run's store moved,
# ends the wait of members whose forwarder could not reach the old store.
NODE_LOST_DECISION = "lost 0"
NODE_RANKS_ENV = "FTRUN_NODE_RANKS"  # "<node> <first global rank> <count>" of the worker's node
NODE_STORE_ENV = "FTRUN_NODE_STORE"  # "<host>:<port>" of the worker's node's store


def relayed_node(env: Mapping[str, str]) -> Optional[Tuple[int, int, int, str]]:
    """(node, first global rank, count, node store address) of a worker whose node relays, from the
    environment its ftrun set; None when it does not (or it is malformed): it uses the run's store."""
    spec = env.get(NODE_RANKS_ENV, "").split()
    addr = env.get(NODE_STORE_ENV)
    if len(spec) != 3 or not addr or not all(p.isdigit() for p in spec):
        return None
    return int(spec[0]), int(spec[1]), int(spec[2]), addr


def node_count_key(node: int, quorum: int, round_: int) -> str:
    return f"{PREFIX}ln/{node}/{quorum}/{round_}"


def node_decision_key(node: int, quorum: int, round_: int) -> str:
    return f"{PREFIX}ld/{node}/{quorum}/{round_}"


def node_forwarded_key(node: int, quorum: int, round_: int) -> str:
    return f"{PREFIX}lf/{node}/{quorum}/{round_}"


# A relayed node's workers write their status reports (progress_key, info_key) to their node's
# store too; the node's ftrun copies its workers' info keys into this one key of the run's store,
# JSON {"<rank>": <that rank's info object, as written>}, whenever one changed (4 a second), and
# the keeper reads one key per relayed node instead of one per replica.
def node_info_key(node: int) -> str:
    return f"{PREFIX}li/{node}"


def inc_key(rank: int) -> str:
    return f"{PREFIX}inc/{rank}"      # live incarnation of the replica, or "dead"


def join_key(rank: int) -> str:
    return f"{PREFIX}join/{rank}"     # incarnation that asks to join


def entered_key(rank: int) -> str:
    return f"{PREFIX}entered/{rank}"  # incarnation that has entered a quorum (votes from now on)


def survivor_key(rank: int) -> str:
    # A wire.SurvivorReport: what a replica holds when it rejoins after the run's store moved; the
    # keeper makes the holder of the newest complete step the source of the first quorum.
    return f"{PREFIX}survivor/{rank}"


def healed_key(rank: int) -> str:
    return f"{PREFIX}healed/{rank}"   # incarnation that holds the committed state


def heal_key(quorum: int, round_: int, shard: Optional[int] = None) -> str:
    # "ok"/"fail": the source's word that its transfer of the quorum ended (the state
    # itself goes over the process group, never through the store); one per shard index
    # when replicas are sharded (--replica-size > 1)
    return f"{PREFIX}heal/{quorum}/{round_}" + (f"/{shard}" if shard is not None else "")


def dataset_key(loader: int) -> str:
    # "<rank> <size> <fingerprint or ->": the dataset of ft.DataLoader #loader as the first worker
    # to build it holds it (compare_set); every other worker compares its own with it
    # (ftrun/worker/ft/api/data_checks.py)
    return f"{PREFIX}data/{loader}"


EVENTS = PREFIX + "events"  # queue: "<rank> <inc> spawn|died|finished" (other nodes), "<rank> <inc> rejoin <next>"


def info_key(rank: int) -> str:
    return f"{PREFIX}info/{rank}"     # a wire.MemberReport: where the member is (the keeper's, `ftrun status`)


# --checkpoint-dir: the newest checkpoint a replica published (or resumed from), as JSON
# {"step", "path", "bytes", "write_s", "pause_s", "time", ...} for `ftrun status`; the
# checkpoint itself is on disk, never in the store.
CHECKPOINT = PREFIX + "checkpoint"
# Saves that wrote nothing (a full disk, an I/O error): a counter (store.add) over the run, and the
# last failure as JSON {"step", "why", "final", "time", "failed"} (failed: the counter after it).
# CHECKPOINT's JSON holds "failed", the counter when it was published: the failures since are the
# difference.
CHECKPOINT_FAILED = PREFIX + "checkpoint-failed"
CHECKPOINT_FAILURE = PREFIX + "checkpoint-failure"
# A stop signal with --checkpoint-dir: the writing replica's word once the checkpoint of the last
# committed step is written (or could not be): JSON {"step", "ok", "path" | "why"}.
STOP_SAVE = PREFIX + "stop-save"
# A line ftrun.ft writes into a worker's stderr for the rank's log file only: the console
# filter (ftrun/supervisor/workers/logs.py) keeps it off the console unless --verbose.
DETAIL_PREFIX = "ftrun.ft: detail: "

# ---------------------------------------------------------------- exit statuses
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


def parse_key(key: str) -> Optional[Tuple[str, Tuple[int, ...]]]:
    """The kind of one of the keys above and the numbers it names, in order ("d", (quorum,
    round)); ("ln", (node, quorum, round)); ("pg", (quorum, round[, shard])) for a group's keys,
    whatever follows), or None for a key outside the protocol's prefix. The keeper and the
    node relays find the keys they collect by this, not by splitting names of their own."""
    if not key.startswith(PREFIX):
        return None
    kind, *rest = key[len(PREFIX):].split("/")
    nums = []
    for part in rest:
        try:
            nums.append(int(part))
        except ValueError:
            break
    return kind, tuple(nums)


def pg_prefix(quorum: int, round_: int, shard: Optional[int] = None) -> str:
    # Named by the round at which members (re)build it: every member rebuilds at the
    # same rounds (after a switch or a failed round), so the name needs no counter.
    # Sharded replicas: one group per shard index (worker j of every replica).
    return f"{PREFIX}pg/{quorum}/{round_}/" + (f"{shard}/" if shard is not None else "")


def replica_prefix(replica: int, incarnation: int) -> str:
    return f"{PREFIX}replica/{replica}/{incarnation}/"  # a sharded replica's own default group


def feed_ask_key(rank: int) -> str:
    # "<feeder rank> <incarnation> <serial>": a waiting hot spare asks that training replica to
    # feed it each step (ft/heal/feed.py); the state itself goes over their group, never the store
    return f"{PREFIX}feed/{rank}"


def feed_sent_key(spare: int, incarnation: int, serial: int) -> str:
    return f"{PREFIX}feedsent/{spare}/{incarnation}/{serial}"  # the newest step its feeder has sent it


def feed_prefix(spare: int, incarnation: int, serial: int) -> str:
    return f"{PREFIX}feedpg/{spare}/{incarnation}/{serial}/"  # the group of a spare and its feeder


@dataclass(frozen=True)
class Quorum:
    """Who takes part from a round on: (rank, incarnation) pairs, which of them must heal, and
    from whom. Written by the keeper's core (supervisor/ft/keeper/core.py) alone; a member reads
    it and never recomputes what it says."""

    id: int
    members: Tuple[Tuple[int, int], ...]
    healers: Tuple[int, ...] = ()
    # No member holds committed state (the first quorum, or every holder died):
    # the lowest rank's state is sent to the others.
    fresh: bool = False
    # Every member is new (no member of the previous quorum is alive): they start at
    # this round. Otherwise (-1) the continuing members switch by their votes; the
    # first to enter writes its round into start_key, where every other member and
    # every joiner begins.
    start_round: int = -1
    # Steps per round (one vote each round), the same for every member: a member that ended its
    # round after a different count would wait for a decision while its peers wait for its
    # collective. Sharded replicas and layout rounds take one step a round whatever this says.
    round_steps: int = 1
    # A stop signal with --checkpoint-dir: at the switch to this quorum every member stops (no
    # group, no step), the workers of replica `writer` save the step they hold (-1: no replica
    # holds the trained state, nothing is saved), and all wait to be stopped.
    stop: bool = False
    writer: int = -1
    # Steps between the guard's periodic checks (a round begins at each multiple), the same for
    # every member; 0: none (after a heal the members check once all the same).
    check_steps: int = 0
    # The heal's source, one rank per shard (worker i of one replica for shard i, so that every
    # shard comes from the same step): the keeper's choice, the lowest replica holding the state.
    # A heal's transfer and a spare's feed both start there. Empty: nobody heals (a stop quorum).
    sources: Tuple[int, ...] = ()

    @property
    def ranks(self) -> List[int]:
        return sorted(r for r, _ in self.members)

    def source(self, shard: int = 0) -> Optional[int]:
        """The rank that sends shard `shard` (rank % --replica-size) of the committed state, or None."""
        return self.sources[shard] if shard < len(self.sources) else None

    def incarnation(self, rank: int) -> int:
        return dict(self.members)[rank]

    def to_json(self) -> str:
        d = {"id": self.id, "members": [list(m) for m in self.members], "healers": list(self.healers),
             "fresh": self.fresh, "start_round": self.start_round, "round_steps": self.round_steps}
        if self.stop:
            d.update(stop=True, writer=self.writer)
        if self.check_steps:
            d["check_steps"] = self.check_steps
        if self.sources:
            d["sources"] = list(self.sources)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text) -> "Quorum":
        d = json.loads(text)
        return cls(d["id"], tuple(sorted((int(r), int(k)) for r, k in d["members"])), tuple(d.get("healers", ())),
                   bool(d.get("fresh", False)), int(d.get("start_round", -1)), int(d.get("round_steps", 1)),
                   bool(d.get("stop", False)), int(d.get("writer", -1)), int(d.get("check_steps", 0)),
                   tuple(int(r) for r in d.get("sources", ())))
