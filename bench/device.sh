#!/usr/bin/env bash
# One call on the GPU machine: set it up, run what the variables name, and tar everything into $OUT.
#
#   JOBS_A="24|auto|350M 760M;24|compile|350M" bash bench/device.sh       (repository root, $OUT set)
#   bash bench/device.sh JOBS_A="24|autog|4.2B" JOBS_B="16|auto|1.3B" LANES="a b"   (the same, as arguments)
#   bash bench/device.sh --help
#
# Set-up: the DeepSpeed wheels carried in .whl/ (../shared/anchors.md says how to build them) go to
# /tmp/site on PYTHONPATH; `pip install -e .`; the machine's facts (GPUs, cores, memory, torch, the CPU
# and NUMA layout, the GPU's NUMA node, transparent huge pages, the commit) go to machine.txt;
# TORCHINDUCTOR_COMPILE_THREADS is 8 unless set, and 1 if a compile with those workers fails.
#
# What runs, in this order; every variable may be set in the environment or as NAME=VALUE arguments,
# and an empty one skips its part:
#   TESTS        pytest arguments (GPU test files), run first in lane a; stopped with SIGINT after
#                TESTS_TIMEOUT seconds (300) so that the failures so far still print.
#   EXTRA        any command line (bash -c), run in lane a after the tests, e.g. a harness:
#                EXTRA='python3 bench/step_trace.py --size 760M --json $O/a/extra/trace.json'.
#                $O (the work folder) and DEADLINE_AT (the deadline, seconds since the epoch) are
#                exported; files written under $O/a/extra come back in the tarball.
#   MAIN=1       the README's main job (examples/train_gpt.py) in lane a.
#   JOBS_A, JOBS_B  bench/peers.py runs of lane a and lane b, ";"-separated, each
#                "CAP_GIB|SYSTEMS|SIZES[|LABEL[|PEERS ARGS]]": SYSTEMS is any of peers.py's systems
#                (space-separated), and the words "auto" (protrain_offload --offload auto: the backend
#                chooses every count for the capped device, Inductor's allocation plan judging on
#                CUDA), "autoi" / "autog" (the same judged by Inductor / by the graph analysis),
#                "peers" (fsdp2 and DeepSpeed's modes: deepspeed superoffload deepcompile zenflow),
#                "ds" (the DeepSpeed modes alone); LABEL names the output folder capCAP_LABEL (a
#                second job at one cap); PEERS ARGS are more arguments of peers.py (--ladder,
#                --offload SPEC ..., --plan SPEC ..., --steps N: the last given wins). CAP 0 is
#                uncapped (the ceiling: "0|compile|4.2B").
#                Default JOBS_A: "24|compile|350M;24|auto|350M 760M 1.3B 4.2B".
#   PROTOCOL     B24 (default) or B24-L (8 micro-batches of 8 x 1024 per optimizer step), for every
#                job (peers.py --protocol; a job's PEERS ARGS may give its own).
#   DP           N > 0: every job data-parallel over N GPUs of this host (peers.py --dp N: each run
#                under torchrun, N processes); needs LANES=ab. Each GPU is capped at CAP_GIB.
#   LANES        "ab" (default): lane a then lane b on one GPU; "a b": side by side on a 2-GPU machine,
#                each lane its own GPU and 16 cores (they share the host's memory bandwidth, so
#                offloaded steps run slower than alone).
#   DEADLINE_S   every run is planned to end this many seconds after the start (560); peers.py skips a
#                run whose expected wall no longer fits and records it as not_run.
#   STEPS        timed steps after the 2 warm-up ones (6: reaches the backend's rate window, calls 3-8;
#                12 also times a re-plan, calls 9-14). STREAM: steps after those with no device sync
#                between them (peers.py --stream-steps). HOST_GIB: the host RAM an offloading run may
#                assume (120, what the one-GPU machine has free). PEERS_REREAD=N: peers.py reads the
#                profile's inputs again after each run.
#   CACHE_FROM   a machine-cache folder (an earlier call's a/cache) copied in first: later plans are
#                priced at the rates that call's training kept.
#   RESUME_FROM  an earlier call's tarball, unpacked into the working tree: its results are copied
#                into the work folder first, so each job resumes where that call stopped (peers.py
#                --resume; the same JOBS, PROTOCOL, DP and STEPS).
#   WORK, NAME   the work folder (/tmp/device) and the tarball's name ($OUT/device.tgz).
#   SETUP=0      skip the installs (a dry run off the GPU machine, e.g. with jobs on --device cpu).
set -u
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
for arg in "$@"; do
  case $arg in
    [A-Z]*=*) export "${arg?}" ;;
    *) echo "bench/device.sh: arguments are NAME=VALUE (see --help), not '$arg'" >&2; exit 2 ;;
  esac
done

export PYTHONUNBUFFERED=1
# NVLink multicast stays off (the device library's KINDS.md: it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
export O=${WORK:-/tmp/device}
mkdir -p "$O/a" "$O/b"
if [ -n "${RESUME_FROM:-}" ]; then
  [ -d "$RESUME_FROM" ] || { echo "bench/device.sh: RESUME_FROM=$RESUME_FROM is not a folder" >&2; exit 2; }
  cp -r "$RESUME_FROM"/. "$O"/
fi
PROTOCOL=${PROTOCOL:-B24} DP=${DP:-0}
case $PROTOCOL in B24|B24-L) ;; *) echo "bench/device.sh: PROTOCOL is B24 or B24-L, not '$PROTOCOL'" >&2; exit 2 ;; esac
case $DP in ''|*[!0-9]*) echo "bench/device.sh: DP is a number of GPUs, not '$DP'" >&2; exit 2 ;; esac
export DEADLINE_AT=$(( $(date +%s) + ${DEADLINE_S:-560} ))
NAME=${NAME:-device}
LANES=${LANES-ab}
if [ "$DP" -gt 0 ] && [ "$LANES" != ab ]; then
  echo "bench/device.sh: DP=$DP uses the GPUs of one job; LANES must be ab, not '$LANES'" >&2; exit 2
fi
export TESTS=${TESTS-} TESTS_TIMEOUT=${TESTS_TIMEOUT:-300} EXTRA=${EXTRA-} MAIN=${MAIN-}
export HOST_GIB=${HOST_GIB:-120} STEPS=${STEPS:-6} STREAM=${STREAM:-0} CACHE_FROM=${CACHE_FROM-}
JOBS_A=${JOBS_A-"24|compile|350M;24|auto|350M 760M 1.3B 4.2B"}
JOBS_B=${JOBS_B-}

# --- set-up -------------------------------------------------------------------------------------
if [ "${SETUP:-1}" != 0 ]; then
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$O/pip.log" 2>&1
fi
{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi -L; nvidia-smi topo -m; nproc; free -g | head -2
  echo "PROTOCOL=$PROTOCOL DP=$DP NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
  python3 -c 'import importlib.metadata as m; print("deepspeed", m.version("deepspeed"))' 2>/dev/null || echo "deepspeed not installed"
  python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA|L3|Hypervisor)'
  for d in /sys/bus/pci/devices/*; do  # the GPU's PCIe function and its NUMA node
    case "$(cat "$d/class" 2>/dev/null)" in 0x03*) echo "GPU $(basename "$d") numa_node=$(cat "$d/numa_node" 2>/dev/null)";; esac
  done
  echo "transparent_hugepage: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
} > "$O/machine.txt" 2>&1
# Parallel Inductor compile shortens every first step; fall back to one thread if the workers fail.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}
if ! timeout 120 python3 -c '
import torch
f = torch.compile(lambda x: (x.sin() * 2).sum())
print("compile workers ok", f(torch.ones(4, device="cuda")).item())' > "$O/compile_check.log" 2>&1; then
  export TORCHINDUCTOR_COMPILE_THREADS=1
fi
echo "TORCHINDUCTOR_COMPILE_THREADS=$TORCHINDUCTOR_COMPILE_THREADS" >> "$O/machine.txt"

# --- the lanes ----------------------------------------------------------------------------------
left() { echo $((DEADLINE_AT - $(date +%s))); }

lane() {  # lane NAME JOBS
  local name=$1 jobs=$2 job cap systems sizes label args out est
  export PROTRAIN_CACHE_DIR=$O/$name/cache  # the measured machine rates and op times land in the tarball
  if [ -n "$CACHE_FROM" ] && [ -d "$CACHE_FROM" ]; then
    mkdir -p "$PROTRAIN_CACHE_DIR" && cp -r "$CACHE_FROM"/. "$PROTRAIN_CACHE_DIR"/
  fi
  if [ "$name" = a ] && [ -n "$TESTS" ]; then
    # shellcheck disable=SC2086
    timeout -s INT -k 30 "$TESTS_TIMEOUT" python3 -m pytest -q -s -rfE --tb=short --durations=0 -p no:cacheprovider \
      $TESTS > "$O/a/pytest.log" 2>&1
    echo "pytest exit $?" >> "$O/a/pytest.log"
  fi
  if [ "$name" = a ] && [ -n "$EXTRA" ]; then
    mkdir -p "$O/a/extra"; bash -c "$EXTRA" > "$O/a/extra.log" 2>&1; echo "extra exit $?" >> "$O/a/extra.log"
  fi
  if [ "$name" = a ] && [ -n "$MAIN" ]; then
    timeout 100 python3 examples/train_gpt.py --out "$O/a/main" > "$O/a/main.log" 2>&1; echo "exit $?" >> "$O/a/main.log"
  fi
  local list
  IFS=';' read -ra list <<< "$jobs"
  for job in "${list[@]}"; do
    [ -z "$job" ] && continue
    IFS='|' read -r cap systems sizes label args <<< "$job"
    # a run's expected wall (peers.py skips it with less left): the automatic runs' walls on the
    # H200, by the job's largest size (350M 105 s, 760M 124-131, 1.3B 202-271, 4.2B 217-352)
    est=120; [[ "$sizes" == *760M* ]] && est=140; [[ "$sizes" == *1.3B* ]] && est=210; [[ "$sizes" == *4.2B* ]] && est=300
    [ "$PROTOCOL" = B24-L ] && est=$((est * 2))  # eight micro-batches a step
    local extra=(--default-estimate-s "$est") words=() word
    [ "$PROTOCOL" != B24 ] && extra+=(--protocol "$PROTOCOL")
    [ "$DP" -gt 0 ] && extra+=(--dp "$DP")
    for word in $systems; do
      case $word in
        auto) words+=(protrain_offload); extra+=(--offload auto) ;;
        autoi) words+=(protrain_offload); extra+=(--offload auto:inductor) ;;
        autog) words+=(protrain_offload); extra+=(--offload auto:graph) ;;
        peers) words+=(fsdp2 deepspeed superoffload deepcompile zenflow) ;;
        ds) words+=(deepspeed superoffload deepcompile zenflow) ;;
        *) words+=("$word") ;;
      esac
    done
    systems="${words[*]}"
    out="$O/$name/cap$cap${label:+_$label}"
    local resume=(); [ -f "$out/peers.json" ] && resume=(--resume "$out/peers.json")
    # shellcheck disable=SC2086
    python3 bench/peers.py --sizes $sizes --systems $systems "${extra[@]}" --cap-gib "$cap" --host-ram-gib "$HOST_GIB" \
      --steps "$STEPS" --stream-steps "$STREAM" --out "$out" "${resume[@]}" --deadline-s "$(left)" ${args:-} \
      >> "$O/$name/peers_cap$cap.log" 2>&1
  done
}

if [ "$LANES" = ab ]; then  # the one-GPU machine
  lane a "$JOBS_A"; lane b "$JOBS_B"
else
  (export CUDA_VISIBLE_DEVICES=0; taskset -pc 0-15 $BASHPID > /dev/null; lane a "$JOBS_A") &
  (export CUDA_VISIBLE_DEVICES=1; taskset -pc 16-31 $BASHPID > /dev/null; lane b "$JOBS_B") &
  wait
fi

# --- results ------------------------------------------------------------------------------------
free -g | head -2 >> "$O/machine.txt"
tar czf "$OUT/$NAME.tgz" -C "$O" .
cat "$O/machine.txt"; tail -n 60 "$O/a/pytest.log" 2>/dev/null; tail -n 40 "$O/a/extra.log" 2>/dev/null
grep -h "exit\|tok\|peak" "$O"/a/main.log 2>/dev/null | tail -n 6
for f in "$O"/*/cap*/peers.md; do [ -f "$f" ] && { echo "== $f"; tail -n 12 "$f"; }; done
for f in "$O"/*/peers_cap*.log; do [ -f "$f" ] && { echo "== $f"; grep -hE "OOM|crash|not_run|refused|Error" "$f" | tail -n 8; }; done
