"""Every environment variable ftrun sets for a worker or reads, with its meaning: the one registry.

The reference page of the docs site is generated from this table, and a test
checks that every `FTRUN_` name used anywhere in ftrun/ (and in the project's
shell scripts) is listed here, so the reference cannot drift from the code.
Declarations only: this module must never import torch, read the environment
or anything of ftrun's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

# Who sets the variable, and so how a reader should take it.
TORCHRUN = "torchrun"      # set in every worker, with torchrun's value
WORKER = "worker"          # ftrun's own, set in every worker
SETTING = "setting"        # a user may set it in ftrun's environment to change a behaviour
INTERNAL = "internal"      # between ftrun's own processes; never set it yourself
TEST = "test"              # fault injection and knobs for the test suite
DEVELOPMENT = "development"  # read by the project's scripts (setup, tests)

KINDS: Dict[str, str] = {
    TORCHRUN: "torchrun's variables, set in every worker with the values torchrun gives",
    WORKER: "ftrun's own variables, set in every worker",
    SETTING: "settings a user may put in ftrun's environment",
    INTERNAL: "between ftrun's own processes (never set them yourself)",
    TEST: "fault injection and knobs for the test suite",
    DEVELOPMENT: "read by the project's scripts",
}


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str
    meaning: str
    default: str = ""     # the value (or rule) that holds when the variable is unset
    when: str = ""        # for worker variables: when ftrun sets it ("" = always)


VARIABLES: Tuple[EnvVar, ...] = (
    # ---- torchrun's worker environment (ftrun.supervisor.workers.env; tests/test_env_contract.py, test_torchrun_oracle.py)
    EnvVar("RANK", TORCHRUN, "The worker's global rank: node rank x workers per node + local rank."),
    EnvVar("LOCAL_RANK", TORCHRUN, "The worker's rank on its node (0 with --virtual-local-rank)."),
    EnvVar("WORLD_SIZE", TORCHRUN, "Workers in the run: nodes x workers per node (under --ft on an elastic run: "
           "the slots when the node joined)."),
    EnvVar("LOCAL_WORLD_SIZE", TORCHRUN, "Workers on this node (--nproc)."),
    EnvVar("GROUP_RANK", TORCHRUN, "The node's rank."),
    EnvVar("GROUP_WORLD_SIZE", TORCHRUN, "Nodes in the run."),
    EnvVar("ROLE_NAME", TORCHRUN, "--role (default: default)."),
    EnvVar("ROLE_RANK", TORCHRUN, "The worker's rank among its role: its RANK."),
    EnvVar("ROLE_WORLD_SIZE", TORCHRUN, "Workers of the role: WORLD_SIZE."),
    EnvVar("MASTER_ADDR", TORCHRUN, "Where the run's store is: this node's FQDN on one node (--local-addr if "
           "given), --master-addr (static), the hosting node's FQDN (c10d)."),
    EnvVar("MASTER_PORT", TORCHRUN, "The run's store's port: a free one on one node unless given, --master-port "
           "(static), the endpoint's port (c10d)."),
    EnvVar("TORCHELASTIC_RESTART_COUNT", TORCHRUN, "How many times this worker's group (or, with --ft, this "
           "replica) was restarted; on c10d, rendezvous rounds count too."),
    EnvVar("TORCHELASTIC_MAX_RESTARTS", TORCHRUN, "--max-restarts."),
    EnvVar("TORCHELASTIC_RUN_ID", TORCHRUN, "--rdzv-id, or torchrun's value: a fresh uuid on one node, none on "
           "a static layout without --rdzv-id."),
    EnvVar("TORCHELASTIC_USE_AGENT_STORE", TORCHRUN, "True: the workers' store is the agent's (ftrun's)."),
    EnvVar("TORCHELASTIC_ERROR_FILE", TORCHRUN, "LOG_DIR/rank<N>/error.json, where torch's @record writes a "
           "worker's error (ftrun's bootstrap writes it too when the script does not); ftrun names a "
           "failure from it."),
    EnvVar("TORCHELASTIC_SIGNALS_TO_HANDLE", TORCHRUN, "--signals-to-handle, comma-separated."),
    EnvVar("TORCH_NCCL_ASYNC_ERROR_HANDLING", TORCHRUN, "1 unless already set, as torchrun sets it."),
    EnvVar("OMP_NUM_THREADS", TORCHRUN, "1 when unset and more than one worker runs on the node, as torchrun "
           "sets it.", when="more than one worker and no value of your own"),
    EnvVar("CUDA_VISIBLE_DEVICES", TORCHRUN, "With --virtual-local-rank: the worker's own device only.",
           when="--virtual-local-rank"),
    # ---- ftrun's own, in every worker (ftrun.supervisor.workers.env)
    EnvVar("FTRUN_RUN_ID", WORKER, "ftrun's name of the run (--run-id; shown by ftrun status)."),
    EnvVar("FTRUN_STORE", WORKER, "host:port of the run's store, hosted by node 0's ftrun."),
    EnvVar("FTRUN_FT", WORKER, "1 under --ft, else 0."),
    EnvVar("FTRUN_HOOK", WORKER, "The --hook spec as JSON (empty without --hook): the worker puts it on every "
           "DDP model."),
    EnvVar("FTRUN_REPLICA_SIZE", WORKER, "--replica-size: workers per replica."),
    EnvVar("FTRUN_SPARES", WORKER, "--spares: replicas held back as hot spares; WORLD_SIZE // FTRUN_REPLICA_SIZE - "
           "FTRUN_SPARES replicas train (ft.num_replicas() counts those taking part now).", when="--spares"),
    EnvVar("FTRUN_REPLICA_ID", WORKER, "The worker's replica: RANK // --replica-size."),
    EnvVar("FTRUN_STEP_TIMEOUT", WORKER, "--step-timeout in seconds: the worker also counts forward passes and "
           "torch.save/load as progress.", when="--step-timeout"),
    EnvVar("FTRUN_STACKS_FILE", WORKER, "LOG_DIR/rank<N>/stacks.log, where the worker writes its Python stacks "
           "when ftrun finds it hung (the console gets one line naming the file)."),
    EnvVar("FTRUN_CHECKPOINT_DIR", WORKER, "--checkpoint-dir, made absolute.", when="--checkpoint-dir"),
    EnvVar("FTRUN_CHECKPOINT_EVERY", WORKER, "--checkpoint-every: committed steps between checkpoints.",
           when="--checkpoint-dir"),
    EnvVar("FTRUN_CHECKPOINT_KEEP", WORKER, "--checkpoint-keep: good checkpoints kept.", when="--checkpoint-dir"),
    EnvVar("FTRUN_NODE_STORE", WORKER, "host:port of this node's own store, where the worker votes, reports its "
           "progress, and learns the run's store's next address if it moves.",
           when="--ft on several nodes, every node but the store's host"),
    EnvVar("FTRUN_NODE_RANKS", WORKER, "'<node> <first global rank> <rank count>' of the worker's node.",
           when="--ft on several nodes, every node but the store's host"),
    # ---- settings
    EnvVar("FTRUN_HOME", SETTING, "Folder of the runs' state (and default logs).",
           "$XDG_RUNTIME_DIR/ftrun, else /tmp/ftrun-UID"),
    EnvVar("FTRUN_VERBOSE", SETTING, "1: as --verbose (ftrun's per-rank lines on the console too); --quiet wins "
           "over it.", "0"),
    EnvVar("FTRUN_PROGRESS", SETTING, "0: no progress line for ftrun's own long waits (nodes joining, a replica "
           "healing or resuming from a checkpoint); it is drawn only when stderr is a terminal.", "1"),
    EnvVar("FTRUN_NO_SLURM", SETTING, "1: ignore the SLURM_* variables altogether.", "0"),
    EnvVar("FTRUN_NODE_TIMEOUT", SETTING, "Seconds without a node's heartbeat before it counts as lost "
           "(0.5 to 3600).", "3"),
    EnvVar("FTRUN_STORE_MOVES", SETTING, "0: the run's store never moves when its node is lost (torchrun's "
           "behaviour under c10d).", "1"),
    EnvVar("FTRUN_HANG_AFTER_S", SETTING, "Seconds of the default hang rule (no --step-timeout): a worker "
           "stopped this long, or under --ft one its peers waited for this long while it did nothing (no CPU, no "
           "I/O, no child at work), or a restarted replica that did nothing this long before rejoining, is hung "
           "(1 to 86400; anything else is refused at the start).", "60"),
    EnvVar("FTRUN_FT_TIMEOUT", SETTING, "--ft: seconds a collective, a group formation or a chunk of a heal may "
           "take before it counts as failed (NCCL groups get twice this).", "10"),
    EnvVar("FTRUN_FT_VOTE_TIMEOUT", SETTING, "--ft: seconds a worker waits in a call on the run's store for a "
           "round's decision (torch's client timeout).", "600"),
    EnvVar("FTRUN_FT_ROUND_STEPS", SETTING, "--ft: steps per round (one vote each), 1 to 1024; unset, rounds "
           "are one step until the run's pace is known, then last about 0.2 s (re-sized then), 8 steps at "
           "most.", "unset"),
    EnvVar("FTRUN_FT_CHECK_S", SETTING, "--ft: seconds of training between the guard's checks that every replica "
           "holds the same state (a fingerprint of its parameters, buffers, optimizers and registered state, "
           "compared across the quorum; also once after every heal); 0 turns the guard off.", "300"),
    EnvVar("FTRUN_FT_CHECK_STEPS", SETTING, "--ft: steps between the guard's checks, instead of about "
           "FTRUN_FT_CHECK_S seconds of them.", "unset"),
    EnvVar("FTRUN_FT_CHUNK_MB", SETTING, "--ft: largest slice, in MiB, in which a heal sends a tensor (1 to "
           "4096).", "64"),
    EnvVar("FTRUN_HOOK_LOG_EVERY", SETTING, "Steps between a hook's traffic lines in each rank's log (0: only "
           "at exit).", "100"),
    EnvVar("FTRUN_ZYGOTE", SETTING, "0: start every worker as a new Python process instead of forking it from "
           "the zygote (each start then imports torch: a second or more).", "1"),
    EnvVar("FTRUN_ZYGOTE_WARM", SETTING, "1: without --ft too, the zygote pre-imports the modules DDP imports "
           "lazily (off by default: it made a worker hang at exit now and then in two-node runs).", "0"),
    # ---- between ftrun's processes
    EnvVar("FTRUN_ZYGOTE_FD", INTERNAL, "The zygote's end of its socket pair with the supervisor."),
    EnvVar("FTRUN_SUPERVISOR_PID", INTERNAL, "The supervisor's pid, for the zygote's parent-death check."),
    EnvVar("FTRUN_ZYGOTE_PREIMPORT", INTERNAL, "--ft: the training frameworks the script imports (Lightning, the Trainer, Accelerate, Fabric), "
           "which the zygote imports before its first fork, so a restarted replica does not import them again."),
    # ---- tests
    EnvVar("FTRUN_RUN_ID_DEFAULT", TEST, "The run id to use when none is given (instead of a fresh one)."),
    EnvVar("FTRUN_FT_INJECT_FAIL", TEST, "'RANK:STEP': that rank's first incarnation votes that step down after "
           "its collectives went through (a mixed outcome)."),
    EnvVar("FTRUN_FT_INJECT_STORE", TEST, "'RANK:INCARNATION=HOST:PORT': that worker takes the store there for the "
           "run's until it follows a move (another store answering at the run's address)."),
    EnvVar("FTRUN_FT_INJECT_SEND_DELAY", TEST, "Seconds a heal's source waits before sending (widens the window "
           "in which it can be killed mid-transfer)."),
    EnvVar("FTRUN_CHECKPOINT_INJECT_DELAY", TEST, "'STEP:SECONDS': hold the write of that step before it is "
           "published."),
    EnvVar("FTRUN_CHECKPOINT_FRESH_STAGER", TEST, "1: a fresh DCP stager for every save."),
    EnvVar("FTRUN_CHECKPOINT_VERIFY", TEST, "0: checkpoints are written without checksums (torch's record "
           "CRCs off in the writer thread, no CRC of .metadata) and checked for being whole only; 'alternate': "
           "every other save without (scripts/bench_checkpoint.py measures what they cost).", default="1"),
    EnvVar("FTRUN_INJECT_PROGRESS_FAIL", TEST, "'START:COUNT': those progress writes to the store fail."),
    EnvVar("FTRUN_INJECT_ZYGOTE_GARBAGE", TEST, "1: the zygote sends one malformed message first."),
    EnvVar("FTRUN_INJECT_JOIN_HOLD", TEST, "A file: a late node holds, taken in but not joined, until it exists."),
    # ---- the project's scripts
    EnvVar("FTRUN_TORCH", DEVELOPMENT, "scripts/setup.sh: the torch requirement to install when none is "
           "importable.", "torch==2.13.0"),
    EnvVar("FTRUN_SKIP_LIGHTNING", DEVELOPMENT, "scripts/test.sh: 1 skips installing Lightning for its test.", "0"),
    EnvVar("FTRUN_SKIP_HF", DEVELOPMENT, "scripts/test.sh: 1 skips installing transformers and accelerate for the "
           "Hugging Face Trainer's test.", "0"),
    EnvVar("FTRUN_SKIP_DATASETS", DEVELOPMENT, "scripts/test.sh: 1 skips installing datasets for the test of a "
           "Hugging Face stream through ft.DataLoader.", "0"),
    EnvVar("FTRUN_DOCS_MERMAID", DEVELOPMENT, "scripts/docs.sh: the mermaid script the site draws its diagrams "
           "with (fetched from the npm registry when npm is there).", "unset: the theme loads it when viewed"),
)

BY_NAME: Dict[str, EnvVar] = {v.name: v for v in VARIABLES}


def of_kind(kind: str) -> Tuple[EnvVar, ...]:
    return tuple(v for v in VARIABLES if v.kind == kind)
