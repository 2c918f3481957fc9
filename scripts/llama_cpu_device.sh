#!/bin/bash
# pysmoe against llama.cpp's native CPU build on the device machine's host CPU (no network there):
#   bash scripts/llama_cpu_device.sh build                          # lib, llama.cpp, vault, GGUF, smoke tests
#   bash scripts/llama_cpu_device.sh warm THREADS LLAMA_THREADS [TASKSET_CPUS] [REPEATS]
# run from the repository root, with three ignored folders carried (bench/RESULTS.md, "A 16-core
# Sapphire Rapids", says how they were made):
#   .peer/llama.cpp-min.tar.gz  vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist, its top level
#                               (CMakeLists.txt CMakePresets.json cmake common ggml src include vendor
#                               tools gguf-py licenses LICENSE app): 10 MB
#   .peer/py                    that sdist's llama_cpp/ (without lib/ and server/) and diskcache/
#   .whl                        cffi and pycparser wheels for the machine's Python (cp312)
# `build` makes pysmoe's library, llama.cpp's shared libraries (GGML_NATIVE=ON), the a3b vault cut to
# 8 layers (pysmoe synth, seed 0) and its GGUF (scripts/export_gguf.py), and checks both engines run;
# where the image's Python has loaded an older libstdc++ than its g++ builds against (llama.cpp then
# dies at its first std::stringstream), it preloads g++'s own. `warm` runs bench/peer.py's warm mode
# (llama.cpp's default OpenMP policy) and writes its JSON to $OUT.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
W=/tmp/ll
export PYTHONPATH=/tmp/py:/tmp/site
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s] $*"; }

llama_smoke() {
    timeout 120 python3 - <<'EOF'
import llama_cpp, time
llm = llama_cpp.Llama(model_path="/tmp/a3b8.gguf", n_ctx=512, n_threads=4, verbose=False)
t = time.perf_counter(); llm.eval(list(range(100, 108))); print("llama smoke ok", time.perf_counter() - t)
EOF
}

build_llama() { # $1: build dir, $2: extra C/CXX flags, $3: extra link flags
    cmake -S $W -B "$1" -G Ninja -DCMAKE_SHARED_LINKER_FLAGS="$3" -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_FLAGS="$2" -DCMAKE_CXX_FLAGS="$2" >"$OUT/cfg.log" 2>&1 || { tail -20 "$OUT/cfg.log"; return 1; }
    cmake --build "$1" --target llama -j "$(nproc)" >"$OUT/llbuild.log" 2>&1 || { tail -20 "$OUT/llbuild.log"; return 1; }
    rm -rf /tmp/py && cp -r .peer/py /tmp/py && mkdir -p /tmp/py/llama_cpp/lib && cp -a "$1"/bin/*.so* /tmp/py/llama_cpp/lib/
}

case $1 in
build)
    [ -f /tmp/build-done ] && { el "built before"; exit 0; }
    lscpu >"$OUT/lscpu.txt"; grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E 'avx512|amx|vnni' | tr '\n' ' '; echo
    nproc; free -g | head -2; cat /sys/kernel/mm/transparent_hugepage/enabled
    make lib -j"$(nproc)" >"$OUT/make.log" 2>&1 || { tail -30 "$OUT/make.log"; exit 1; }
    el "pysmoe built: $(python3 -c 'from pysmoe._ffi import ffi, lib; print(ffi.string(lib.smoe_kernels()).decode())')"
    (python3 -m pysmoe synth /tmp/a3b8p --preset a3b --layers 8 --quiet >"$OUT/synth.log" 2>&1; echo "synth rc $?" >>"$OUT/synth.log") &
    mkdir -p $W && tar xzf .peer/llama.cpp-min.tar.gz -C $W
    build_llama $W/build "" || exit 1
    el "llama.cpp built"
    wait; cat "$OUT/synth.log" | tail -3
    el "vault synthesised"
    PYTHONPATH=$W/gguf-py:$PYTHONPATH python3 scripts/export_gguf.py /tmp/a3b8p /tmp/a3b8.gguf.part --threads "$(nproc)" \
        >"$OUT/export.log" 2>&1 && mv /tmp/a3b8.gguf.part /tmp/a3b8.gguf || { tail -20 "$OUT/export.log"; exit 1; }
    el "GGUF exported"
    if ! llama_smoke; then
        # the image's Python may have loaded an older libstdc++ than the one this g++ built against
        export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)
        el "native llama.cpp failed: again with LD_PRELOAD=$LD_PRELOAD"
        echo "export LD_PRELOAD=$LD_PRELOAD" >/tmp/llama-env
        if ! llama_smoke; then
            unset LD_PRELOAD; rm -f /tmp/llama-env
            el "rebuilding with libstdc++ linked in"
            build_llama $W/build2 "" "-static-libstdc++ -static-libgcc" || exit 1
            if ! llama_smoke; then
                el "rebuilding without AMX"
                build_llama $W/build3 "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" "-static-libstdc++ -static-libgcc" || exit 1
                llama_smoke || exit 1
            fi
        fi
    fi
    el "llama.cpp smoke ok"
    python3 -c "
import pysmoe, time
v = pysmoe.open_vault('/tmp/a3b8p'); s = v.session(threads=$(nproc))
t = time.perf_counter(); s.prefill(list(range(100, 108))); print('pysmoe smoke ok', time.perf_counter() - t)"
    touch /tmp/build-done
    el done
    ;;
warm)
    [ -f /tmp/llama-env ] && . /tmp/llama-env
    TH=$2; LT=$3; TS=${4:-}; R=${5:-5}
    PRE=()
    [ -n "$TS" ] && PRE=(taskset -c "$TS")
    el "peer warm threads $TH llama $LT taskset '${TS}'"
    timeout "${LIMIT:-560}" "${PRE[@]}" python3 bench/peer.py /tmp/a3b8p --gguf /tmp/a3b8.gguf --modes warm --prompt-lengths 8,45,256 \
        --threads "$TH" --llama-threads "$LT" --omp-policies default --repeats "$R" --decode-tokens 16 \
        --thp always --json "$OUT/peer-warm-t$TH${TS:+-c$TS}.json" 2>&1 | tail -40
    el done
    ;;
esac
