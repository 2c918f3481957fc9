#!/bin/bash
# Two builds of pysmoe against each other on one GPU machine, in one device call:
#   bash scripts/cuda_ab.sh OTHER [ROUNDS] [-- cuda_bench.py arguments]
# OTHER  a second checkout (e.g. `git worktree add .ab gpu-next`, carried to the device machine:
#        run(carry=[".ab"]) — a nested checkout travels without its files unless carried)
# Builds both with CUDA, runs tests/test_cuda.py on each, makes the a3b vault once ($SMOE_A3B,
# default /tmp/a3b; SMOE_AB_LAYERS layers, default 48), then runs bench/cuda_bench.py ROUNDS times
# (default 2) for each, alternating this checkout and OTHER, each record to $OUT/ab-{this,other}-R.json
# and its whole output (with --profile's tables) to $OUT/ab-{this,other}-R.log. SMOE_AB_TESTS=this
# runs the tests on this checkout only, =none on neither.
set -o pipefail
OTHER=$1
shift
ROUNDS=2
if [ $# -gt 0 ] && [ "$1" != "--" ]; then ROUNDS=$1; shift; fi
[ "$1" = "--" ] && shift
[ -d "$OTHER" ] || { echo "usage: bash scripts/cuda_ab.sh OTHER [ROUNDS] [-- bench args]"; exit 2; }
OUT=${OUT:-cuda-out}
VAULT=${SMOE_A3B:-/tmp/a3b}
mkdir -p "$OUT"
THIS=$PWD
OTHER=$(cd "$OTHER" && pwd)
for side in this other; do
    dir=$THIS
    [ $side = other ] && dir=$OTHER
    make -C "$dir" -j"$(nproc)" CUDA=1 lib >"$OUT/build-$side.log" 2>&1 || { tail -20 "$OUT/build-$side.log"; exit 1; }
    grep -E "warning" "$OUT/build-$side.log" | head -5
    [ "${SMOE_AB_TESTS:-both}" = none ] || { [ "${SMOE_AB_TESTS:-both}" = this ] && [ $side = other ]; } && continue
    (cd "$dir" && timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -3) |
        tee "$OUT/test-$side.log"
done
[ -d "$VAULT" ] || python3 -m pysmoe synth "$VAULT" --preset a3b --layers "${SMOE_AB_LAYERS:-48}" --quiet || exit 1
touch "$VAULT.ready" # for a job waiting on the vault (scripts/llama_cuda_device.sh's export, say)
for r in $(seq 1 "$ROUNDS"); do
    for side in this other; do
        dir=$THIS
        [ $side = other ] && dir=$OTHER
        echo "== $side, round $r"
        # run from $dir: the bench puts "." first on sys.path (before PYTHONPATH), so each side must
        # start in its own checkout to load its own pysmoe and libsmoe (the line "library" says which)
        (cd "$dir" && python3 "$THIS/bench/cuda_bench.py" "$VAULT" --skip budget --cold-repeats 0 \
            --json "$OUT/ab-$side-$r.json" "$@" 2>&1) | tee "$OUT/ab-$side-$r.log" |
            grep -E "^library|^resident|rror|Traceback"
    done
done
