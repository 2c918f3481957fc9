#!/bin/bash
# llama.cpp's CUDA build on the same weights as pysmoe, on a GPU machine without network, in one call:
#   bash scripts/llama_cuda_device.sh SRC.tar.gz VAULT [extra llama-bench arguments]
# SRC.tar.gz  llama.cpp's source tree at its top level (vendor/llama.cpp of the llama-cpp-python
#             sdist, say, without its docs/ and models/: ~10 MB to carry); its gguf-py is used too
# VAULT       a pysmoe vault llama.cpp can express (python -m pysmoe synth VAULT --preset a3b)
# It builds llama-bench with CUDA for this machine's GPU (cmake and ninja: pip wheels if the machine
# has none), writes VAULT as a GGUF (scripts/export_gguf.py: Q4_0 experts, Q8_0 dense, bench/peer.md),
# and runs llama-bench with every layer on the GPU, flash attention off and on, micro-batches of
# 512 and 1,024: the fastest row of each test is llama.cpp at its best. Logs and llama-bench's JSON
# go to $OUT (default llama-out); the work tree to $LLAMA_WORK (default /tmp/llama-cuda). Run again on
# the same machine, it skips what is done (the build, the GGUF): a build cut short by a call's time
# limit goes on where it stopped. LLAMA_STEPS=build stops after the build, LLAMA_STEPS=build,export
# after the export (to build while the GPU does other work, and bench later on the warm machine).
# LLAMA_BENCH_ARGS replaces llama-bench's arguments (not -m and -o); with LLAMA_NCMOE="0 8 ..." it runs
# once per --n-cpu-moe value (that many layers' experts kept in host RAM, on the CPU) and records each
# run's peak VRAM (nvidia-smi every 100 ms) beside its rows: llama.cpp on a GPU smaller than the model.
set -o pipefail
[ $# -ge 2 ] || { sed -n 2,12p "$0"; exit 2; }
SRC=$1
VAULT=$2
shift 2
OUT=${OUT:-llama-out}
W=${LLAMA_WORK:-/tmp/llama-cuda}
mkdir -p "$OUT" "$W"
ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
[ -n "$ARCH" ] || { echo "no GPU (nvidia-smi)"; exit 1; }
tar xzf "$SRC" -C "$W" || exit 1
command -v cmake >/dev/null || { echo "no cmake (pip install cmake ninja)"; exit 1; }
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)

t0=$(date +%s)
if [ ! -x "$W/build/bin/llama-bench" ]; then
    cmake -S "$W" -B "$W/build" "${GEN[@]}" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release \
        >"$OUT/llama-configure.log" 2>&1 || { tail -20 "$OUT/llama-configure.log"; exit 1; }
    cmake --build "$W/build" --target llama-bench -j "$(nproc)" >"$OUT/llama-build.log" 2>&1 ||
        { tail -20 "$OUT/llama-build.log"; exit 1; }
fi
echo "llama-bench built for sm_$ARCH in $(($(date +%s) - t0)) s"
STEPS=${LLAMA_STEPS:-build,export,bench}
[[ $STEPS == *export* ]] || exit 0

t0=$(date +%s)
MODEL="$W/$(basename "$VAULT").gguf" # one GGUF a vault, so that a second vault gets its own
if [ ! -s "$MODEL" ]; then
    PYTHONPATH="$W/gguf-py${PYTHONPATH:+:$PYTHONPATH}" python3 scripts/export_gguf.py "$VAULT" "$MODEL.part" \
        --threads "$(nproc)" >"$OUT/export.log" 2>&1 || { tail -20 "$OUT/export.log"; exit 1; }
    mv "$MODEL.part" "$MODEL" # whole or not at all: a call cut short starts the export again
fi
echo "GGUF written in $(($(date +%s) - t0)) s: $(du -h "$MODEL" | cut -f1)"
[[ $STEPS == *bench* ]] || exit 0

read -r -a ARGS <<<"${LLAMA_BENCH_ARGS:--ngl 99 -fa 0,1 -b 2048 -ub 512,1024 -p 45,256,1024 -n 32 -r 3}"
JSONS=()
for N in ${LLAMA_NCMOE:-none}; do
    tag=${N/none/all}
    NC=()
    [ "$N" = none ] || NC=(-ncmoe "$N")
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$OUT/vram-$tag.log" 2>/dev/null &
    poll=$!
    "$W/build/bin/llama-bench" -m "$MODEL" "${ARGS[@]}" "${NC[@]}" -o json "$@" >"$OUT/llama-bench-$tag.json" \
        2>"$OUT/llama-bench-$tag.log"
    rc=$?
    kill "$poll" 2>/dev/null
    [ $rc = 0 ] || { tail -20 "$OUT/llama-bench-$tag.log"; exit 1; }
    echo "n_cpu_moe=$tag: peak VRAM $(sort -n "$OUT/vram-$tag.log" | tail -1) MiB"
    JSONS+=("$OUT/llama-bench-$tag.json")
done
python3 - "${JSONS[@]}" <<'EOF'
import json, sys
rows = [r for f in sys.argv[1:] for r in json.load(open(f))]
best = {}
for r in rows:
    test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    setting = f"fa={int(r.get('flash_attn', 0))} ub={r.get('n_ubatch')} t={r.get('n_threads')} ncmoe={r.get('n_cpu_moe', 0)}"
    print(f"{test:8s} {setting:32s} {r['avg_ts']:10.1f} tok/s (± {r.get('stddev_ts', 0):.1f})")
    if r["avg_ts"] > best.get(test, (0, ""))[0]:
        best[test] = (r["avg_ts"], setting)
print("llama.cpp at its best: " + json.dumps({t: {"tok_s": round(v, 1), "setting": s} for t, (v, s) in best.items()}))
EOF
