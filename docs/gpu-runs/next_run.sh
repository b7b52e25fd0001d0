#!/bin/bash
# What the next GPU runs first, in one device call (at most 600 s) that this script keeps within
# one deadline, DEADLINE_S seconds from its start. From the repository's root, on a machine whose
# python3 has torch (at least requirements.txt's floor), pytest and pytest-xdist:
#
#     OUT=gpu-out bash docs/gpu-runs/next_run.sh
#
# The stages, in order (README.md beside this script says what each step runs and when it
# passes; tests/test_next_run.py keeps its list and this script's alike):
#   0. the machine: GPU, driver, torch, CUDA, NCCL, the commit
#   1. probes of what no GPU has run (issue 45, items 3-7; issue 50's memory), short runs side by
#      side on the GPU
#   2. graphed against eager on the same steps, side by side: equal val_loss and parameters
#   3. the GPU tests on eight workers (make test-gpu), then benchmark.py
#   4. the epochs behind issue 35's targets, at local batch 256 and 32, one at a time
# Each step writes the whole output (stderr, tracebacks) and the exit status of each of its
# commands into $OUT/<stage>-<step>/, and one line into $OUT/summary.txt: PASS, REFUSED (an
# option refused in one line, which a probe accepts), FAIL with its status, or SKIPPED where too
# little of the deadline was left to start it; a step that ended before its verdict (its shell
# gone) stays FAIL (no verdict). A failing step never stops the next one; the script's own status
# is 1 where any step failed. Then copy $OUT into a dated folder here, with this script, and
# write its README.
#
# It installs nothing (the GPU machines reach no package index). PY: the Python (default
# python3, the machines' own); DEADLINE_S: the deadline in seconds, 540 by default and at most
# (the call's 600 s less the machine's start and the copy back).
set -u -o pipefail

DEADLINE_S=${DEADLINE_S:-540}
GRACE_S=5 # a command still running GRACE_S after its timeout's SIGTERM is killed
SMALL_S=60 # a short run's timeout: about 10 s alone on an H200, longer side by side
SKIPPED=200 # step statuses beyond any command's (timeout's own are 124-127 and 137)
REFUSED=201
VAL_LOSS_TOL=1e-4 # one unit of [METRIC]'s last val_loss digit: equal runs print equal values
PARAM_TOL=1e-6    # tests/test_gpu.py's bound on graphed against eager final parameters

# 32 steps an epoch: the capture after 11 eager steps, then replays. --deterministic: graphed
# and eager runs of the same kernels end equal to the bit.
SMALL=(--dataset synthetic --train-samples 2048 --val-samples 512 --batch-size 64
    --print-every 100000 --deterministic)
# Issue 35's epochs: 50,000 augmented images, as a CIFAR-10 epoch.
EPOCHS=(--dataset synthetic --train-samples 50000 --val-samples 10000 --augment --no-checkpoint
    --print-every 100000)

STAGE1=(resume-cpu resume-eager resume-fp16 schedule-resume fsdp2-validation fsdp2-sgd
    classic-loader memory)
STAGE2=(equal-ddp equal-fsdp2 equal-schedule equal-grad-accum equal-clip)
STAGE3=(gpu-tests benchmark)
STAGE4=(epochs-ddp-b256-graphed epochs-ddp-b256-eager epochs-ddp-b32-graphed
    epochs-ddp-b32-eager epochs-fsdp2-b256-graphed epochs-fsdp2-b256-eager
    epochs-fsdp2-b32-graphed epochs-fsdp-b256-eager profile-ddp-b256-graphed targets)

OUT=${OUT:-gpu-out}
PY=${PY:-python3}
SUMMARY=$OUT/summary.txt
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((T0 + DEADLINE_S - $(date +%s))); }

# run LOG CAP NEED CMD...: CMD, its whole output and exit status appended to LOG, under a
# timeout of CAP seconds or what is left of the deadline (less the grace), whichever is less;
# not started (status SKIPPED) where that is under NEED seconds. Its status: CMD's, 124 on a
# timeout.
run() {
    local log=$1 cap=$2 need=$3 t rc=0
    shift 3
    t=$(($(left) - GRACE_S))
    ((t > cap)) && t=$cap
    if ((t < need)); then
        echo "== skipped at t=$(elapsed)s: ${t}s left of the deadline, ${need}s needed: $*" >>"$log"
        return "$SKIPPED"
    fi
    echo "== t=$(elapsed)s, timeout ${t}s: $*" >>"$log"
    timeout -k "$GRACE_S" "$t" "$@" >>"$log" 2>&1 || rc=$?
    echo "== rc=$rc t=$(elapsed)s" >>"$log"
    return "$rc"
}

# note DIR TEXT: the step's one-line detail in the summary.
note() { echo "$2" >"$1/note"; }

# last_error DIR: the last error line that the logs of the step in DIR hold.
last_error() {
    grep -hE '^(error: |[[:alnum:]_.]*(Error|Exception): )' "$1"/*.log | tail -n 1
}

# train DIR NAME ARGS...: a short run of main.py, its output in DIR/NAME.log.
train() {
    local dir=$1 name=$2
    shift 2
    run "$dir/$name.log" "$SMALL_S" 15 "$PY" main.py "$@"
}

# checkpoints DIR: where the step in DIR writes its checkpoints (not under $OUT: they stay here).
checkpoints() { echo "$WORK/${1##*/}"; }

# compare DIR A B [FROM]: A's and B's val_loss epoch by epoch (DIR/A.log, DIR/B.log) and, where
# they were to write checkpoints, their final parameters' largest difference, into
# DIR/compare.log; status 1 where they differ beyond VAL_LOSS_TOL or PARAM_TOL. FROM: the first
# epoch compared.
compare() {
    run "$1/compare.log" 60 5 "$PY" - "$1" "$(checkpoints "$1")" "$2" "$3" "${4:-1}" \
        "$VAL_LOSS_TOL" "$PARAM_TOL" <<'EOF'
import sys
from pathlib import Path

import checkpoint
from utils import parse_metric
from verify import max_param_diffs

logs, saved, a, b = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
first, val_tol, param_tol = int(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7])


def val_losses(name):
    lines = (logs / f"{name}.log").read_text().splitlines()
    metrics = filter(None, map(parse_metric, lines))
    return {m["epoch"]: m["val_loss"] for m in metrics if m["epoch"] >= first}


ours, theirs = val_losses(a), val_losses(b)
epochs = sorted(ours.keys() | theirs.keys())
print(f"epoch  val_loss {a}  val_loss {b}")
for e in epochs:
    print(f"{e:5d}  {ours.get(e, 'none'):>8}  {theirs.get(e, 'none'):>8}")
bad = [] if epochs else ["no [METRIC] line"]
bad += [f"epoch {e} missing" for e in epochs if e not in ours or e not in theirs]
# Rounded: two values one digit apart differ by 1e-4 and a float's error.
worst = round(max((abs(ours[e] - theirs[e]) for e in ours.keys() & theirs.keys()), default=0), 8)
found = f"val_loss differs by {worst:.4g}"
if worst > val_tol:
    bad.append(f"{found} > {val_tol:g}")
if (saved / a).exists() or (saved / b).exists():  # asked to write checkpoints
    missing = [str(p) for p in (saved / a, saved / b) if not checkpoint.latest(p)]
    if missing:
        bad.append(f"no checkpoint in {', '.join(missing)}")
    else:
        (diff,) = max_param_diffs(saved / a, saved / b)
        found += f", parameters by {diff:.3g}"
        if diff > param_tol:
            bad.append(f"parameters differ by {diff:.3g} > {param_tol:g}")
print(f"FAIL: {'; '.join(bad)}" if bad else f"PASS: {found}")
sys.exit(1 if bad else 0)
EOF
}

# compared DIR A B [FROM]: compare, its verdict the step's note.
compared() {
    local rc=0
    compare "$@" || rc=$?
    note "$1" "$(sed -nE 's/^(PASS|FAIL): //p' "$1/compare.log")"
    return "$rc"
}

# one_line_refusal LOG: the run ended as bad input (status 2) says, with one error: line and
# no traceback.
one_line_refusal() {
    [[ $(grep -c '^error: ' "$1") == 1 ]] && ! grep -q Traceback "$1"
}

# pair DIR REFUSAL ARGS...: ARGS graphed and eager, side by side, then compared. REFUSAL=ok: a
# graphed run refused in one line is an answer too (REFUSED), not a failure.
pair() {
    local dir=$1 refusal=$2 graphed eager g=0 e=0 rc=0 ckpt=() ck
    shift 2
    ck=$(checkpoints "$dir")
    [[ " $* " == *" --no-checkpoint "* ]] || ckpt=(--checkpoint-dir "$ck/graphed")
    train "$dir" graphed "$@" --cuda-graphs "${ckpt[@]}" &
    graphed=$!
    [[ ${#ckpt[@]} == 0 ]] || ckpt=(--checkpoint-dir "$ck/eager")
    train "$dir" eager "$@" --no-cuda-graphs "${ckpt[@]}" &
    eager=$!
    wait "$graphed" || g=$?
    wait "$eager" || e=$?
    if [[ $g == 2 && $refusal == ok ]] && one_line_refusal "$dir/graphed.log"; then
        note "$dir" "$(grep '^error: ' "$dir/graphed.log")"
        return "$REFUSED"
    fi
    if ((g || e)); then
        note "$dir" "status $g graphed, $e eager: $(last_error "$dir")"
        rc=$g
        ((rc)) || rc=$e
        return "$rc"
    fi
    compared "$dir" graphed eager
}

# resume_pair DIR WRITER...: a checkpoint written after 1 epoch by a run of WRITER's options,
# resumed for 2 more epochs graphed and eager, which must train alike (issue 45, item 3: the
# optimizer a graphed run needs, whatever wrote the checkpoint).
resume_pair() {
    local dir=$1 rc=0 written
    shift
    written=$(checkpoints "$dir")/written
    train "$dir" write "${SMALL[@]}" --epochs 1 --checkpoint-dir "$written" "$@" || rc=$?
    if ((rc)); then
        note "$dir" "writing the checkpoint: status $rc"
        return "$rc"
    fi
    pair "$dir" strict "${SMALL[@]}" --epochs 3 --resume "$written"
}

# first_failure: after `CMD || first_failure`, the caller's rc holds the first failed status.
first_failure() {
    local status=$?
    ((rc)) || rc=$status
}

step_env() {
    local log=$1/env.log rc=0
    run "$log" 10 1 date -u || first_failure
    run "$log" 20 1 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv ||
        first_failure
    run "$log" 60 1 "$PY" -c "import sys, torch
print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" ||
        first_failure
    run "$log" 30 1 "$PY" -m pip list --format=freeze || first_failure
    run "$log" 10 1 git log -1 --format=%H || first_failure
    run "$log" 10 1 git status --short || first_failure
    run "$log" 10 1 nproc || first_failure
    return "$rc"
}

# Item 3: an eager checkpoint resumed graphed, from the CPU, from an eager GPU run, from fp16.
step_resume_cpu() { resume_pair "$1" --device cpu; }
step_resume_eager() { resume_pair "$1" --no-cuda-graphs; }
step_resume_fp16() { resume_pair "$1" --no-cuda-graphs --precision fp16; }

# Item 4: a graphed run with a schedule, resumed after epoch 2 of 4 (ckpt_e0003_s000000), ends
# with the parameters of the run that went straight on. [METRIC] has no learning rate, and the
# checkpoints hold the host's rate, not the one a graph read: a rate that stopped following the
# schedule after the resume shows in the parameters.
step_schedule_resume() {
    local dir=$1 rc=0 ck args=("${SMALL[@]}" --epochs 4 --lr-schedule cosine --warmup-epochs 1
        --cuda-graphs)
    ck=$(checkpoints "$dir")
    train "$dir" straight "${args[@]}" --keep-last 0 --checkpoint-dir "$ck/straight" || rc=$?
    if ((rc == 0)); then
        train "$dir" resumed "${args[@]}" --checkpoint-dir "$ck/resumed" \
            --resume "$ck/straight/ckpt_e0003_s000000" || rc=$?
    fi
    if ((rc)); then
        note "$dir" "a graphed run: status $rc"
        return "$rc"
    fi
    compared "$dir" straight resumed 3
}

# Item 5: FSDP2's graphed validation, without the checkpoints whose state-dict hook reshards.
step_fsdp2_validation() {
    pair "$1" strict "${SMALL[@]}" --strategy fsdp2 --epochs 3 --no-checkpoint
}
# Items 6 and 7: refused in one line, or trained as eager.
step_fsdp2_sgd() {
    pair "$1" ok "${SMALL[@]}" --strategy fsdp2 --optimizer sgd --lr 0.05 --lr-schedule cosine \
        --epochs 2
}
step_classic_loader() { pair "$1" ok "${SMALL[@]}" --loader classic --epochs 2; }

# Issue 50: every model x ddp, fsdp, fsdp2 on the one GPU, a model's three side by side (memory
# is per process: their peaks are their own); state_pred against the allocator's state_mem.
step_memory() {
    local dir=$1 rc=0 model strategy pids pid
    for model in cnn cnn-wide resnet18 resnet50; do
        pids=()
        for strategy in ddp fsdp fsdp2; do
            train "$dir" "$model-$strategy" "${SMALL[@]}" --epochs 1 --no-checkpoint \
                --model "$model" --strategy "$strategy" &
            pids+=($!)
        done
        for pid in "${pids[@]}"; do wait "$pid" || first_failure; done
    done
    run "$dir/memory.log" 30 5 "$PY" - "$dir" <<'EOF' || rc=$?
import sys
from pathlib import Path

from utils import parse_metric

rows, unequal = [], []
for log in sorted(Path(sys.argv[1]).glob("*-*.log")):
    metrics = [m for m in map(parse_metric, log.read_text().splitlines()) if m]
    if not metrics:
        unequal.append(f"{log.stem}: no epoch")
        continue
    m = metrics[-1]
    rows.append(f"{log.stem} peak_mem={m['peak_mem']}MB state_mem={m['state_mem']} "
                f"state_pred={m['state_pred']} act_per_image={m['act_per_image']}")
    if m["state_pred"] != m["state_mem"]:
        unequal.append(log.stem)
print("\n".join(rows))
print("memory: " + (f"unequal or missing: {', '.join(unequal)}" if unequal else
                    f"state_pred = state_mem in {len(rows)} runs"))
sys.exit(1 if unequal else 0)
EOF
    note "$dir" "$(grep '^memory: ' "$dir/memory.log")"
    return "$rc"
}

step_equal_ddp() { pair "$1" strict "${SMALL[@]}" --epochs 2; }
step_equal_fsdp2() { pair "$1" strict "${SMALL[@]}" --strategy fsdp2 --epochs 2; }
step_equal_schedule() {
    pair "$1" strict "${SMALL[@]}" --epochs 2 --lr-schedule cosine --warmup-epochs 1
}
step_equal_grad_accum() { pair "$1" strict "${SMALL[@]}" --epochs 2 --grad-accum 2; }
step_equal_clip() { pair "$1" strict "${SMALL[@]}" --epochs 2 --clip-grad 0.5; }

step_gpu_tests() {
    local rc=0
    run "$1/pytest.log" 240 60 "$PY" -m pytest tests -m gpu -rs -v -n 8 -p no:cacheprovider \
        --durations=15 --junitxml="$1/pytest.xml" || rc=$?
    note "$1" "$(grep -E '^=+ .* in [0-9.]+s' "$1/pytest.log" | tail -n 1)"
    return "$rc"
}
step_benchmark() { run "$1/benchmark.log" 150 60 "$PY" benchmark.py; }

# epochs DIR STRATEGY BATCH MODE: one of issue 35's runs (MODE graphed or eager).
epochs() {
    local flag=--no-cuda-graphs
    [[ $4 == graphed ]] && flag=--cuda-graphs
    run "$1/main.log" 60 20 "$PY" main.py "${EPOCHS[@]}" --epochs 3 --strategy "$2" \
        --batch-size "$3" "$flag"
}

# A profiler trace of a graphed epoch's steps, beside the epoch's gpu_busy (issue 35: the two
# compared): one epoch, its trace gzipped into DIR.
step_profile_ddp_b256_graphed() {
    local dir=$1 rc=0 trace
    run "$dir/main.log" 60 20 "$PY" main.py "${EPOCHS[@]}" --epochs 1 --batch-size 256 \
        --cuda-graphs --profile || rc=$?
    trace=$(sed -n 's/^\[PROFILE\].* traced: \(\S*\) .*/\1/p' "$dir/main.log")
    trace=${trace/rank\*/rank0}
    if [[ -f $trace ]]; then
        gzip -c "$trace" >"$dir/trace_rank0.json.gz" || first_failure
    elif ((rc == 0)); then
        note "$dir" "no trace: main.log names none, or it is not there"
        rc=1
    fi
    return "$rc"
}

# Issue 35's targets, from this stage's logs: DDP's graphed epoch <= 0.15 s at b256, FSDP2's <=
# 0.3 s, the step at b32 <= half the step at b256 graphed; each run's last epoch (the first
# holds the capture). Status 1 where one is missed or has no run.
step_targets() {
    local rc=0
    run "$1/targets.log" 30 5 "$PY" - "$OUT" <<'EOF' || rc=$?
import sys
from pathlib import Path

from utils import parse_metric

out = Path(sys.argv[1])


def last_epoch(strategy, batch, mode):
    log = out / f"4-epochs-{strategy}-b{batch}-{mode}" / "main.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    metrics = [m for m in map(parse_metric, lines) if m]
    return metrics[-1] if metrics else None


def step_time(m):
    return m["time"] / (m["train_images"] // m["global_batch"])


verdicts, all_met = [], True
for strategy, bound in (("ddp", 0.15), ("fsdp2", 0.3)):
    big, small = last_epoch(strategy, 256, "graphed"), last_epoch(strategy, 32, "graphed")
    if big is None or small is None:
        verdicts.append(f"{strategy}: no run")
        all_met = False
        continue
    ratio = step_time(small) / step_time(big)
    print(f"{strategy} graphed: epoch at b256 {big['time']} s (target <= {bound}), gpu_busy "
          f"{big['gpu_busy']}; step at b32 / step at b256 {ratio:.2f} (target <= 0.5)")
    targets = {
        f"b256 {big['time']} s": big["time"] <= bound,
        f"b32/b256 {ratio:.2f}": ratio <= 0.5,
    }
    for what, met in targets.items():
        verdicts.append(f"{strategy} {what} {'met' if met else 'MISSED'}")
        all_met &= met
print("targets: " + "; ".join(verdicts))
sys.exit(0 if all_met else 1)
EOF
    note "$1" "$(grep '^targets: ' "$1/targets.log")"
    return "$rc"
}

# step STAGE NAME: the step, in its own folder, and its summary line there (DIR/verdict).
step() {
    local dir=$OUT/$1-$2 rc=0 verdict
    mkdir -p "$dir"
    # Overwritten below: stays only where the step's shell ends first.
    printf '%s %-26s %-18s %s\n' "$1" "$2" "FAIL (no verdict)" "ended before its verdict" \
        >"$dir/verdict"
    case $2 in
    epochs-*)
        local parts
        IFS=- read -ra parts <<<"$2"
        epochs "$dir" "${parts[1]}" "${parts[2]#b}" "${parts[3]}" || rc=$?
        ;;
    *) "step_${2//-/_}" "$dir" || rc=$? ;;
    esac
    if ((rc)) && [[ ! -s $dir/note ]]; then
        note "$dir" "$(last_error "$dir")"
    fi
    case $rc in
    0) verdict=PASS ;;
    "$REFUSED") verdict=REFUSED ;;
    "$SKIPPED") verdict=SKIPPED ;;
    124) verdict="FAIL (timed out)" ;;
    *) verdict="FAIL (status $rc)" ;;
    esac
    printf '%s %-26s %-18s %s\n' "$1" "$2" "$verdict" "$(cat "$dir/note" 2>/dev/null)" \
        >"$dir/verdict"
}

# stage N serial|parallel NAME...: the steps one after another, or side by side; then their
# summary lines, in order.
stage() {
    local n=$1 how=$2 name
    shift 2
    echo "== stage $n ($how) at t=$(elapsed)s"
    for name in "$@"; do
        if [[ $how == parallel ]]; then step "$n" "$name" & else step "$n" "$name"; fi
    done
    wait
    for name in "$@"; do cat "$OUT/$n-$name/verdict"; done | tee -a "$SUMMARY"
}

mkdir -p "$OUT"
: >"$SUMMARY"
WORK=$(mktemp -d) # the runs' checkpoints
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1
stage 0 serial env
stage 1 parallel "${STAGE1[@]}"
stage 2 parallel "${STAGE2[@]}"
stage 3 serial "${STAGE3[@]}"
stage 4 serial "${STAGE4[@]}"
echo "== end at t=$(elapsed)s (deadline ${DEADLINE_S}s)" | tee -a "$SUMMARY"
if grep -qE '^[0-9] \S+ +FAIL ' "$SUMMARY"; then exit 1; fi
