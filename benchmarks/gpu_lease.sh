#!/usr/bin/env bash
# A whole GPU lease (15 minutes of device time, at most 10 per command) in one command of under 9.5 minutes:
#   bench    `make gpu` on a 340 s budget (check, speed with a default-config pass then tuning, end to end,
#            experts; SIGTERM at 380 s still writes the parts done)
#   tests    the GPU tests (pytest -m gpu), 80 s
#   offload  `--offload`'s forward with and without prefetch (benchmarks/bench_offload.py), 40 s
#   loads    Triton 3.6's two 2:4 loads (PATCHC_GROUPS_PER_LOAD=1 and 2), layer speed on default configs, 35 s each
# Each step has its own cap and log in OUT, so one that hangs or fails leaves the others' results; the
# bench records (<device>.jsonl / .md) go to OUT too. Usage: bash benchmarks/gpu_lease.sh OUT_DIR [STEP ...]
# DRY=1 runs the same steps on CPU (the bench's --dry-run, tiny parts, short caps): CI checks the script so.
set -u
out=${1:?usage: gpu_lease.sh OUT_DIR [bench|tests|offload|loads ...]}
shift
steps=${*:-bench tests offload loads}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
dry=${DRY:-}
# SIGINT reset to Python's handler (a shell may start children with it ignored): pytest prints its summary;
# `patchc bench` turns SIGTERM into the same interrupt and writes the parts done
step() { local name=$1 sig=$2 cap=$3; shift 3; local t0=$SECONDS
  timeout -s "$sig" --kill-after=10 "$cap" "$@" > "$out/$name.log" 2>&1; local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (cap $cap s)"; tail -n 4 "$out/$name.log"; }
bench() { local name=$1 cap=$2; shift 2
  if [ -n "$dry" ]; then step "$name" TERM 120 $py -m patchc bench --dry-run --parts experts --no-progress --out "$out"
  else step "$name" TERM "$cap" $py -m patchc bench --no-progress --out "$out" "$@"; fi; }
for s in $steps; do
  case $s in
    bench) bench bench 380 --budget 340 ;;
    tests) files=$(grep -l "mark.gpu" tests/*.py)  # only the files holding GPU tests: collecting all takes ~30 s
      step tests INT $([ -n "$dry" ] && echo 60 || echo 80) $py -c 'import signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(pytest.main(sys.argv[1:]))' \
        -q -m gpu -p no:cacheprovider -n $([ -n "$dry" ] && echo 0 || echo 8) --tb=short $files ;;
    offload) step offload INT 40 $py benchmarks/bench_offload.py --out "$out" ${dry:+--dry-run} ;;
    loads) for g in 1 2; do
        PATCHC_GROUPS_PER_LOAD=$g bench "loads-$g" 35 --parts speed --no-tune --budget 28; done ;;
    *) echo "gpu_lease.sh: unknown step '$s' (bench, tests, offload, loads)" >&2; exit 2 ;;
  esac
done
