#!/bin/bash
# The CUDA backend's build, tests and benchmark on a GPU machine, logs into $OUT (default ./cuda-out).
#   bash scripts/cuda_device.sh [build] [test] [synth LAYERS] [bench "ARGS"]   (stages in that order)
# e.g. bash scripts/cuda_device.sh build test synth 8 bench "--repeats 3"
set -o pipefail
OUT=${OUT:-cuda-out}
mkdir -p "$OUT"
export SMOE_A3B=${SMOE_A3B:-/tmp/a3b}
while [ $# -gt 0 ]; do
    case "$1" in
    build)
        { nvidia-smi; lscpu | head -20; command -v nvcc && nvcc --version; uptime; } >"$OUT/info.txt" 2>&1
        if command -v nvcc >/dev/null; then
            make -j16 CUDA=1 lib >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
        else
            echo "no nvcc: using the carried pysmoe/libsmoe.so" | tee "$OUT/build.log"
        fi
        shift ;;
    test)
        timeout 400 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -40 | tee "$OUT/test_cuda.log"
        shift ;;
    synth)
        t0=$(date +%s)
        python3 -m pysmoe synth "$SMOE_A3B" --preset a3b --layers "$2" --quiet --force 2>&1 | tail -5
        echo "synth a3b --layers $2: $(( $(date +%s) - t0 )) s, $(du -sh "$SMOE_A3B" | cut -f1)" | tee -a "$OUT/synth.log"
        shift 2 ;;
    bench)
        uptime | tee -a "$OUT/bench.log"
        # shellcheck disable=SC2086
        python3 bench/cuda_bench.py "$SMOE_A3B" --json "$OUT/bench.json" $2 2>&1 | tee -a "$OUT/bench.log"
        shift 2 ;;
    *) echo "unknown stage $1"; exit 2 ;;
    esac
done
