#!/bin/bash
# pysmoe against llama.cpp's native CPU build on the device machine's host CPU (no network there):
#   bash scripts/llama_cpu_device.sh build                          # lib, llama.cpp, vault, GGUF, smoke tests
#   bash scripts/llama_cpu_device.sh warm THREADS LLAMA_THREADS [TASKSET_CPUS] [REPEATS]
#   bash scripts/llama_cpu_device.sh qx                             # bench/qx_isa few NPROC, few 4, mv q4: this tree and .peer/old
#   bash scripts/llama_cpu_device.sh ab "CFLAGS" [PROMPTS] [THREADS]  # decode_profile as built, against with CFLAGS
#   bash scripts/llama_cpu_device.sh read                           # qx_isa read: the plain read rate, 1 … NPROC threads
#   bash scripts/llama_cpu_device.sh cold [THREADS] [REPEATS]       # bench/cold_ttft.py at 45, 256 tokens (after build)
#   bash scripts/llama_cpu_device.sh prep [OLD_REV]                 # here, not there: makes the folders below
# run from the repository root, with three ignored folders carried (`prep` makes them on this
# machine from the package registries; .peer/old, the sources of OLD_REV for `qx`, from git):
#   .peer/llama.cpp-min.tar.gz  vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist, its top level
#                               (CMakeLists.txt CMakePresets.json cmake common ggml src include vendor
#                               tools gguf-py licenses LICENSE app): 10 MB
#   .peer/py                    that sdist's llama_cpp/ (without lib/ and server/)
#   .whl                        cffi, pycparser and diskcache wheels for the machine's Python (cp312)
# `build` makes pysmoe's library, llama.cpp's shared libraries (GGML_NATIVE=ON), the a3b vault cut to
# 8 layers (pysmoe synth, seed 0) and its GGUF (scripts/export_gguf.py), and checks both engines run;
# where the image's Python has loaded an older libstdc++ than its g++ builds against (llama.cpp then
# dies at its first std::stringstream), it preloads g++'s own. `warm` runs bench/peer.py's warm mode
# (llama.cpp's default OpenMP policy; SETTLE=MS in the environment: peer.py's --settle-ms) and
# writes its JSON to $OUT.
export PYTHONUNBUFFERED=1
if [ "$1" = prep ]; then # on the developer's machine (network to the registries), before the device call
    set -e
    rm -rf .peer/sd && mkdir -p .peer/sd .whl
    python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .peer/sd
    tar xzf .peer/sd/llama_cpp_python-0.3.36.tar.gz -C .peer/sd
    S=.peer/sd/llama_cpp_python-0.3.36
    (cd $S/vendor/llama.cpp && tar czf ../../../../llama.cpp-min.tar.gz CMakeLists.txt CMakePresets.json cmake common \
        ggml src include vendor tools gguf-py licenses LICENSE app)
    rm -rf .peer/py && mkdir -p .peer/py && cp -r $S/llama_cpp .peer/py/ && rm -rf .peer/py/llama_cpp/lib .peer/py/llama_cpp/server
    rm -rf .peer/sd
    python3 -m pip download -q --only-binary :all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 cffi pycparser diskcache -d .whl
    if [ -n "$2" ]; then rm -rf .peer/old && mkdir -p .peer/old && git archive "$2" csrc bench/qx_isa.c | tar -x -C .peer/old; fi
    ls -la .peer .whl
    exit 0
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ "$1" = qx ] || [ "$1" = ab ] || [ "$1" = read ] || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
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
ab) # the engine's prefill, two builds of bench/decode_profile alternated (3 rounds, medians of 7 each):
    # A as the tree builds it, B with the extra compiler flags $2 (e.g. -DQX512_FEW_N8=8); the
    # environment passes through (SMOE_NO_AMX=1 for a CPU without AMX); makes the vault of `build`
    # (not llama.cpp) where it is missing
    if [ ! -d /tmp/a3b8p ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
        make lib -j"$(nproc)" >"$OUT/make.log" 2>&1 || { tail -30 "$OUT/make.log"; exit 1; }
        python3 -m pysmoe synth /tmp/a3b8p --preset a3b --layers 8 --quiet >"$OUT/synth.log" 2>&1 || { tail "$OUT/synth.log"; exit 1; }
        el "vault synthesised"
    fi
    DS="csrc/[a-z]*.c csrc/engine/*.c csrc/cpu/*.c bench/decode_profile.c"
    DF="-std=c11 -O3 -g -ffp-contract=off -D_GNU_SOURCE -DSMOE_PROFILE=1 -mavx2 -mfma -mf16c -pthread -Icsrc"
    mkdir -p build
    cc $DF $DS -lm -o build/dp_a & cc $DF $2 $DS -lm -o build/dp_b || exit 1
    wait $! || exit 1
    TH=${4:-$(nproc)}
    for r in 1 2 3; do
        for n in $(echo "${3:-8,45}" | tr , ' '); do
            for v in a b; do
                echo "round $r, $n tokens, $v: $(timeout 60 build/dp_$v /tmp/a3b8p "$TH" "$n" 1 7 | grep -m1 'prefill (layer')"
            done
        done
    done
    el done
    ;;
cold) # issue 31 item 2 on this host's disk and cores: cold TTFT against the I/O floor and the
    # compute floor (bench/cold_ttft.py: a fresh process after a page-cache drop each run, 10 % cache)
    TH=${2:-$(nproc)}
    df -T /tmp | tail -1
    if df -T /tmp | tail -1 | grep -q tmpfs; then echo "cold: /tmp is in memory here: no cold read to time"; exit 1; fi
    el "cold_ttft threads $TH"
    timeout "${LIMIT:-560}" python3 bench/cold_ttft.py /tmp/a3b8p --lengths 45,256 --cache-fracs 0.1 --repeats "${3:-5}" \
        --threads "$TH" --compute-floor --json "$OUT/cold-t$TH.json" 2>&1 | tail -30
    el done
    ;;
read) # the machine's plain read rate from memory (the floor of a product bound by its weights)
    mkdir -p build && cc -O3 -std=c11 -ffp-contract=off -D_GNU_SOURCE -mavx2 -mfma -mf16c -Icsrc bench/qx_isa.c \
        csrc/cpu/kernels.c csrc/cpu/kernels_ref.c csrc/cpu/kernels_avx2.c csrc/cpu/kernels_avx512.c csrc/cpu/cpu.c \
        csrc/util.c -lm -pthread -o build/qx_isa || exit 1
    build/qx_isa read "$(nproc)" 2048 | tee "$OUT/read.txt"
    ;;
qx) # the 8-bit-activation product from memory, this tree against .peer/old where prep put one
    QX="bench/qx_isa.c csrc/cpu/kernels.c csrc/cpu/kernels_ref.c csrc/cpu/kernels_avx2.c csrc/cpu/kernels_avx512.c csrc/cpu/cpu.c csrc/util.c"
    QF="-O3 -std=c11 -ffp-contract=off -D_GNU_SOURCE -mavx2 -mfma -mf16c -Icsrc"
    mkdir -p build && cc $QF $QX -lm -pthread -o build/qx_isa || exit 1
    [ -d .peer/old ] && { (cd .peer/old && cc $QF $QX -lm -pthread -o /tmp/qx_old) || exit 1; }
    grep -m1 'model name' /proc/cpuinfo; nproc
    {
        for i in 1 2; do el "few $(nproc), run $i"; build/qx_isa few "$(nproc)"; done
        el "few 4"; build/qx_isa few 4
        for i in 1 2; do
            el "mv q4, this tree ($i)"; build/qx_isa mv q4
            [ -x /tmp/qx_old ] && { el "mv q4, .peer/old ($i)"; /tmp/qx_old mv q4; }
        done
    } 2>&1 | tee "$OUT/qx.txt"
    el done
    ;;
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
        --thp always ${SETTLE:+--settle-ms "$SETTLE"} --json "$OUT/peer-warm-t$TH${TS:+-c$TS}${SETTLE:+-s$SETTLE}.json" 2>&1 | tail -40
    el done
    ;;
esac
