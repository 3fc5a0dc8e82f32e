"""Every store key ftrun's processes share, and what its value holds: the store's one vocabulary.

Supervisors (one per node) and workers talk only through the run's TCPStore
(and, for bulk data, process groups). Every key any of them writes or reads
is named here, with what its value holds, so the two sides cannot drift
apart and a key's meaning is in one place; the values' formats are in
ftrun.wire (the reports, the quorum) and ftrun.votes (a round's counter and
decision). Names only: must never import torch (the supervisor imports it
on its torch-free path), touch a store, nor import anything of ftrun's.
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

# ---------------------------------------------------------------- workers -> supervisor: progress
# A ftrun.wire.ProgressReport (its codec holds the fields), rewritten by every worker's
# heartbeat thread every HEARTBEAT_S (ftrun/worker/progress.py). In the run's
# store, or in the worker's node's store when its node relays (node_info_key).
HEARTBEAT_S = 0.25


def progress_key(rank: int) -> str:
    return f"ftrun/progress/{rank}"


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
# waits for, and what ends the wait (the votes' values: ftrun.votes; a quorum: ftrun.wire.Quorum;
# the round's length: ftrun.pacing):
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
    return f"{PREFIX}quorum/{quorum}"  # a wire.Quorum's JSON, immutable once written


def start_key(quorum: int) -> str:
    return f"{PREFIX}start/{quorum}"   # round at which members switched to the quorum


# A round's votes: one counter per (quorum, round), and its decision, written by the add that
# completes the count (ftrun.votes: the counter's fields, the decision's text, which add closes).
TOP = PREFIX + "top"                  # the newest round whose decision was written (a hint for the keeper)


def count_key(quorum: int, round_: int) -> str:
    return f"{PREFIX}n/{quorum}/{round_}"  # votes.OK_VOTE, ABSTAIN_VOTE, FAIL_VOTE added up


def decision_key(quorum: int, round_: int) -> str:
    # votes.decision_text: "commit E" / "fail E" / "fail E P": E = the newest quorum its author had
    # seen; P = how many of the round's steps stand (kept_key), 0 when absent.
    return f"{PREFIX}d/{quorum}/{round_}"


# A round is up to FTRUN_FT_ROUND_STEPS steps (one vote for them all); a member whose collective
# fails in the round's step P (counted from 0) has taken P of its steps and votes fail, after
# lowering kept_key to P. The round's decision keeps the lowest P: its first P steps succeeded for
# every member, so members holding exactly P steps go on and any member holding more restarts.
def kept_key(quorum: int, round_: int) -> str:
    return f"{PREFIX}p/{quorum}/{round_}"


# Votes through a node's relay (--ft on several nodes): a node's workers vote in their node's own
# store (its standby store, FTRUN_NODE_STORE; the run's store on the node hosting it), and the run's
# store sees one vote per node and round. The add that completes node_count_key (the quorum's members
# on that node) makes its author the node's forwarder: it adds the node's whole count to count_key
# (the fields add up), then copies the round's decision into node_decision_key for the node's other
# members. The keeper's votes for a dead or absent member go to its node's counter while that store
# answers (an add of the keeper's that completes it forwards), to count_key once the node is lost.
# node_forwarded_key: the node's count reached count_key (else the keeper forwards a completed count
# whose forwarder died). votes.NODE_LOST_DECISION, written by the node's ftrun after the run's store
# moved, ends the wait of members whose forwarder could not reach the old store.
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


def feed_answer_key(spare: int, incarnation: int, serial: int) -> str:
    # the feeder's rank, once it answered that ask: the spare forms their group only then
    return f"{PREFIX}feedanswer/{spare}/{incarnation}/{serial}"


def feed_sent_key(spare: int, incarnation: int, serial: int) -> str:
    return f"{PREFIX}feedsent/{spare}/{incarnation}/{serial}"  # the newest step its feeder has sent it


def feed_prefix(spare: int, incarnation: int, serial: int) -> str:
    return f"{PREFIX}feedpg/{spare}/{incarnation}/{serial}/"  # the group of a spare and its feeder


