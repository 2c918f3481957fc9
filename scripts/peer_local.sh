#!/bin/bash
# Issue 31's measurements on this machine's CPU, pysmoe against llama.cpp built for it:
#   bash scripts/peer_local.sh prep      # ~15-30 min, once per CPU: llama-cpp-python built here
#                                        # (GGML_NATIVE), the a3b vaults and their GGUF
#   bash scripts/peer_local.sh all       # ~40 min: every run below, one after another
#   bash scripts/peer_local.sh warm|cold|ttft|floor|matvec   # one of them
# Where the built things go: PEER_DIR (default build/peer: ~12 GB). Results: bench/results/
# peer31-TAG-*.json and *.txt, TAG the CPU (e.g. amd-f25m17); the commands are the ones the
# RESULTS.md sections quote. Run it on a quiet machine; every ratio comes from one alternated run.
#   warm    item 1: everything in memory, 8/45/256 tokens, both OpenMP policies, 9 repeats, twice
#   cold    item 3: the same memory as llama.cpp (its cgroup, pysmoe with the cache it picks there)
#   ttft    item 2: cold TTFT against the I/O floor and the compute floor, 10 % cache
#   floor   item 4: decode under 10 % / 33 % caches against its own floor (realistic routing)
#   matvec  the one-token product's instance: decode_profile with SMOE_MATVEC=avx2 against avx512,
#           alternated (where the CPU has AVX-512)
set -u
cd "$(dirname "$0")/.."
D=${PEER_DIR:-build/peer}
PY=.venv/bin/python
T=$(nproc)
V=$(grep -m1 vendor_id /proc/cpuinfo | awk '{print $3}')
F=$(grep -m1 'cpu family' /proc/cpuinfo | awk '{print $4}')
M=$(grep -m1 -E '^model\s*:' /proc/cpuinfo | awk '{print $3}')
case $V in AuthenticAMD) TAG=amd-f${F}m$M ;; GenuineIntel) TAG=intel-f${F}m$M ;; *) TAG=$(uname -m) ;; esac
CPU="$V family $F model $M, $T CPUs"
R=bench/results
el() { echo "[$(date +%H:%M:%S)] $*"; }
need() { [ -d "$D/llama/llama_cpp" ] && [ "$(cat "$D/llama/cpu.txt" 2>/dev/null)" = "$CPU" ] && [ -f "$D/a3b8.gguf" ] ||
    { echo "run 'bash scripts/peer_local.sh prep' first (for $CPU)"; exit 1; }; }
peer() { PYTHONPATH=$D/llama $PY bench/peer.py "$D/a3b8p" --gguf "$D/a3b8.gguf" --threads "$T" --llama-threads "$T" \
    --omp-policies default,passive "$@"; }

run_warm() {
    local n=0 f # the runs are numbered on from those already in bench/results (a later call keeps the earlier JSON)
    for f in "$R/peer31-$TAG-warm-"*.json; do f=${f##*-}; f=${f%.json}; [[ $f =~ ^[0-9]+$ ]] && ((f > n)) && n=$f; done
    for i in $((n + 1)) $((n + 2)); do
        el "item 1, run $i"
        peer --modes warm --prompt-lengths 8,45,256 --repeats 9 --decode-tokens 16 --thp always --settle-ms 100 \
            --json "$R/peer31-$TAG-warm-$i.json" 2>&1 | grep -E '^\|'
    done
}
run_cold() {
    el "item 3"
    peer --modes cold --prompt-lengths 8,45,256 --repeats 3 --decode-tokens 8 --readahead-kb 128 --budget-mib 1187 \
        --pysmoe-limit own-cache --json "$R/peer31-$TAG-cold.json" 2>&1 | grep -E '^\|'
}
run_ttft() {
    el "item 2"
    $PY bench/cold_ttft.py "$D/a3b8p" --lengths 45,256 --cache-fracs 0.1 --repeats 7 --threads "$T" --compute-floor \
        --json "$R/cold31-$TAG.json" 2>&1 | tail -8
}
run_floor() {
    el "item 4"
    $PY bench/decode_floor.py "$D/a3b12r" --budgets 10,33 --prompt 64 --tokens 32 --repeats 3 --threads "$T" --coherent \
        --json "$R/decode-floor-$TAG.json" 2>&1 | tail -6
}
run_matvec() {
    grep -q avx512_vnni /proc/cpuinfo || { el "matvec: no AVX512-VNNI here, nothing to choose"; return; }
    el "the one-token product: SMOE_MATVEC=avx2 against avx512, 3 rounds"
    mkdir -p build
    cc -std=c11 -O3 -g -ffp-contract=off -D_GNU_SOURCE -DSMOE_PROFILE=1 -mavx2 -mfma -mf16c -pthread -Icsrc \
        csrc/[a-z]*.c csrc/engine/*.c csrc/cpu/*.c bench/decode_profile.c -lm -o build/decode_profile || return 1
    for r in 1 2 3; do for m in avx2 avx512; do
        echo "round $r $m: $(SMOE_MATVEC=$m build/decode_profile "$D/a3b8p" "$T" 8 64 5 2>&1 | grep -E '^decode')"
    done; done | tee "$R/matvec-$TAG.txt"
}

case ${1:-} in
prep)
    set -e
    make venv-test lib >/dev/null
    mkdir -p "$D"
    if [ ! -d "$D/llama/llama_cpp" ] || [ "$(cat "$D/llama/cpu.txt" 2>/dev/null)" != "$CPU" ]; then
        el "llama-cpp-python 0.3.36 built for this CPU (GGML_NATIVE) into $D/llama: 10-25 min"
        rm -rf "$D/llama"
        CMAKE_ARGS="-DGGML_NATIVE=ON" $PY -m pip install -q --no-deps --target "$D/llama" llama-cpp-python==0.3.36
        $PY -m pip install -q --target "$D/llama" diskcache
        echo "$CPU" >"$D/llama/cpu.txt"
    fi
    $PY -m pip install -q gguf
    [ -d "$D/a3b8p" ] || $PY -m pysmoe synth "$D/a3b8p" --preset a3b --layers 8 --quiet
    [ -d "$D/a3b12r" ] || $PY -m pysmoe synth "$D/a3b12r" --preset a3b --layers 12 --routing realistic --quiet
    [ -f "$D/a3b8.gguf" ] || { $PY scripts/export_gguf.py "$D/a3b8p" "$D/a3b8.gguf.part" --threads "$T" &&
        mv "$D/a3b8.gguf.part" "$D/a3b8.gguf"; }
    PYTHONPATH=$D/llama $PY -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    el "ready: $CPU"
    ;;
warm) need; run_warm ;;
cold) need; run_cold ;;
ttft) need; run_ttft ;;
floor) need; run_floor ;;
matvec) need; run_matvec ;;
all)
    need
    el "$CPU: $(lscpu | grep -m1 'Model name' | sed 's/  */ /g')"
    run_warm; run_cold; run_ttft; run_floor; run_matvec
    el done
    ;;
*) sed -n 2,15p "$0"; exit 2 ;;
esac
