#!/usr/bin/env bash
# `make gpu` in under 3 minutes, for a short GPU lease: the GPU tests (the first failures, with
# tracebacks), what tuning one 7B layer costs (benchmarks/bench_tune.py), then the bench's check, speed and
# end-to-end parts with the default configs. Each step has its own time cap and log, so one that hangs or
# fails leaves the others' results. Usage: bash benchmarks/gpu_short.sh OUT_DIR
set -u
out=${1:?usage: gpu_short.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
# SIGINT, reset to Python's handler (a shell may start children with it ignored): pytest then prints its
# summary; `patchc bench` turns SIGTERM into the same interrupt and writes the parts done
step() { local name=$1 sig=$2 cap=$3; shift 3; local t0=$SECONDS
  timeout -s "$sig" --kill-after=10 "$cap" "$@" > "$out/$name.log" 2>&1; local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (cap $cap s)"; tail -n 4 "$out/$name.log"; }
step pytest INT 35 $py -c 'import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main(sys.argv[1:]))' -q -m gpu -p no:cacheprovider -n 8 --maxfail=3 --tb=short \
  $(grep -l "mark.gpu" tests/*.py)  # only the files holding GPU tests: collecting all takes ~30 s
TRITON_CACHE_DIR=$(mktemp -d) step tune TERM 35 $py benchmarks/bench_tune.py --out "$out/tune.jsonl"
step bench TERM 80 $py -m patchc bench --parts check speed e2e --no-tune --budget 66 --no-progress --out "$out"
