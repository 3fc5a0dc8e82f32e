#!/bin/bash
# What only a GPU machine can show, in one go (run it there; nothing in CI needs it):
#   0. the quick tier on that machine's torch with the GPU hidden (gloo, as on a CPU machine):
#      a point of the supported torch range (GPU_CHECK_QUICK=0 skips it),
#   1. the hook catalogue on a CUDA model with NCCL (one rank),
#   2. --ft on a CUDA model: NCCL epoch group, the vote's settle on the GPU stream,
#   3. FSDP2 under --ft on CUDA (one worker per replica) with DTensor checkpoints,
#   4. a SIGKILLed --ft worker on CUDA that resumes from its durable checkpoint,
#   5. no warning in any of their output.
# One GPU cannot hold two NCCL ranks, so replicas healing from a peer are not checked here.
# Prints one "gpu_check: ok|FAILED ..." line per check; exits 1 if any failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 FTRUN_HOME=${FTRUN_HOME:-$(mktemp -d)}
LOG=${LOG_DIR:-$(mktemp -d)}
fails=0
verdict() {  # verdict NAME RC [LOGFILE]
    if [ "$2" = 0 ]; then echo "gpu_check: ok $1"; else echo "gpu_check: FAILED $1 (exit $2)"; fails=$((fails + 1)); [ -n "${3:-}" ] && tail -20 "$3"; fi
}
$PY -c "import torch; print('gpu_check: torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"

if [ "${GPU_CHECK_QUICK:-1}" = 1 ]; then
    # (not *.log: its test names say "warning", which the last check looks for in the runs' logs)
    f="$LOG/quick.txt"
    # Some tests run the `ftrun` command itself: installed, without dependencies, when missing.
    [ -x "$(dirname "$($PY -c 'import sys; print(sys.executable)')")/ftrun" ] ||
        $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
    CUDA_VISIBLE_DEVICES= timeout 400 $PY -m pytest -q -p no:cacheprovider -m quick tests >"$f" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR) " "$f" | head -20
    verdict "the quick tier, GPU hidden: $(tail -n 1 "$f")" $rc
fi

while read -r name flags; do
    f="$LOG/hook-$name.log"
    $PY -m ftrun --nproc 1 $flags scripts/train_ddp.py --steps 40 --dim 256 --hidden 1024 --print-every 20 >"$f" 2>&1
    rc=$?
    [ $rc = 0 ] && ! grep -q "hook" "$f" && rc=3  # the hook's figures line must be there
    verdict "hook $name ($flags)" $rc "$f"
done <<'HOOKS'
allreduce --hook allreduce
fp16 --hook fp16
bf16 --hook bf16
powersgd --hook powersgd --rank 1 --start-iter 5
powersgd-r4-fp16 --hook powersgd --rank 4 --start-iter 5 --wrap fp16
batched-powersgd --hook batched-powersgd --rank 1 --start-iter 5
localsgd --hook localsgd --period 4 --start-iter 5
noop --hook noop
HOOKS

f="$LOG/ft.log"
$PY -m ftrun --nproc 1 --ft scripts/train_ft.py --steps 300 --dim 256 --hidden 1024 --optim adamw --print-every 100 >"$f" 2>&1
rc=$?
[ $rc = 0 ] && ! grep -q "done at step 300" "$f" && rc=3
verdict "--ft on a CUDA model, 300 steps" $rc "$f"

f="$LOG/fsdp-ft.log"
ck2=$(mktemp -d)
$PY -m ftrun --nproc 1 --ft --replica-size 1 --checkpoint-dir "$ck2" --checkpoint-every 20 scripts/train_fsdp_ft.py \
    --steps 60 >"$f" 2>&1
rc=$?
[ $rc = 0 ] && ! grep -q "done at step 60" "$f" && rc=3
[ $rc = 0 ] && [ ! -d "$ck2/step-60" ] && rc=4
verdict "FSDP2 under --ft on CUDA (ft.device_mesh on LOCAL_RANK's GPU, ft.replicate, DTensor checkpoints)" $rc "$f"

f="$LOG/ft-kill.log"
ck=$(mktemp -d)
$PY -m ftrun --nproc 1 --ft --checkpoint-dir "$ck" --checkpoint-every 50 scripts/train_ft.py --steps 400 \
    --dim 256 --hidden 1024 --optim adamw --step-sleep 0.01 --print-every 25 >"$f" 2>&1 &
sup=$!
for _ in $(seq 600); do grep -q "step 200 " "$f" && break; sleep 0.1; done
pid=$(pgrep -f "ftrun\[rank 0\]" | head -1)
[ -n "$pid" ] && kill -9 "$pid" && echo "gpu_check: SIGKILL to the worker (pid $pid) after step 200"
wait $sup
rc=$?
[ $rc = 0 ] && ! grep -q "done at step 400" "$f" && rc=3
# Checkpoints every 50 steps: the newest one complete at the kill is of step 150 or 200.
[ $rc = 0 ] && ! grep -Eq "resumed from checkpoint .*/step-(150|200) " "$f" && rc=4
[ $rc = 0 ] && grep -Eq "not written|failed while writing|not published" "$f" && rc=5
verdict "--ft worker killed at step 200 on CUDA resumes from its newest checkpoint" $rc "$f"
grep -i "checkpoint\|resum\|restart" "$f" | head -8

# A quiet console: no warning from ftrun's zygote or its NCCL groups in any of the runs above.
warned=$(grep -il "warning" "$LOG"/*.log)
[ -z "$warned" ]
verdict "no warning printed by any run" $? "${warned%%$'\n'*}"
exit $((fails > 0))
