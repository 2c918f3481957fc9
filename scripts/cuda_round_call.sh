#!/bin/bash
# One device call (~10 min) for issue 30: run from the repository root on a GPU machine with these carried
# (device run carry=[".whl", ".ab", ".llbin"], made in the session that calls):
#   .whl/   cffi, pycparser, gguf wheels for the machine's Python (pip download --python-version 3.12 ...)
#   .ab/    a worktree of main cut to csrc/, pysmoe/, Makefile, setup files and bench/cuda_bench.py: the A side
#   .llbin/llbin.tar.xz  from scripts/llama_cuda_local.sh
# CAP (seconds, default 585) bounds the whole; logs come back as $OUT/callM.tgz. Bench rows: main, this
# checkout, SMOE_CUDA_PDL=2, llama.cpp at its best (flash attention 0/1, micro-batch 512/1,024, -d 4096),
# SMOE_CUDA_PDL=2 SMOE_CUDA_MULTI=1; then the fat build with CUDA_FORCE_PTX_JIT=1 (compute_80 PTX on this GPU).
set -o pipefail
export PYTHONUNBUFFERED=1 CUDA_ARCH="-gencode arch=compute_90,code=sm_90"
RET=${OUT:-/tmp/out}; OUT=/tmp/logs; mkdir -p $OUT $RET
trap 'tar czf $RET/callM.tgz -C /tmp/logs . 2>/dev/null' EXIT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
CAP=${CAP:-585}; left() { echo $(( CAP - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
{ nvidia-smi; lscpu | grep -E "Model name|^CPU\(s\)|Flags"; nvcc --version | tail -2; } > $OUT/info.txt 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
rm -f /tmp/ready /tmp/built; (while [ ! -f /tmp/built ]; do sleep 1; done; python3 -m pysmoe synth /tmp/a3b --preset a3b --layers 48 --quiet --force > $OUT/synth.log 2>&1; el synth >> $OUT/synth.log
 python3 scripts/export_gguf.py /tmp/a3b /tmp/a3b.gguf --threads 8 > $OUT/export.log 2>&1; el "export rc=$?" >> $OUT/synth.log; touch /tmp/ready) &
(python3 -c "import tarfile; tarfile.open('.llbin/llbin.tar.xz').extractall('/tmp')"; make -C .ab -j6 CUDA=1 lib > $OUT/build-main.log 2>&1; echo "main build rc=$?" >> $OUT/build-main.log) &
make -j10 CUDA=1 lib > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
touch /tmp/built; el "build: warnings $(grep -c -i warning $OUT/build.log)"
(env -u CUDA_ARCH make -j4 CUDA=1 BUILD=/tmp/build-fat /tmp/build-fat/libsmoe.so > $OUT/build-fat.log 2>&1; echo "fat build rc=$?" >> $OUT/build-fat.log) &
SMOE_CUDA_PDL=2 SMOE_CUDA_MULTI=1 timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_qwen_hybrid.py tests/test_ggml_formats.py tests/test_gguf_import.py tests/test_paged_embedding.py -k "gpu or cuda" 2>&1 | tail -8 | tee $OUT/tests-pdl2-multi.log
el tests-pdl2-multi
SMOE_CUDA_PDL=2 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "bit_identical or every_range or batch or agrees_with or union" 2>&1 | tail -2 | sed 's/^/PDL=2: /' | tee $OUT/tests-pdl2.log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "bit_identical or every_range or batch or agrees_with or union" 2>&1 | tail -2 | sed 's/^/default: /' | tee $OUT/tests-default.log
el tests-default
while [ ! -f /tmp/ready ]; do sleep 2; done; cat $OUT/synth.log; tail -1 $OUT/build-main.log
LL=/tmp/llbin
libdirs=$(find / -xdev \( -name "libcublas.so.13" -o -name "libcudart.so.13" -o -name "libcublasLt.so.13" \) 2>/dev/null | xargs -n1 dirname | sort -u | tr '\n' ':')
lb() { LD_LIBRARY_PATH=$LL:$libdirs$LD_LIBRARY_PATH timeout $(left) $LL/llama-bench -m /tmp/a3b.gguf -ngl 99 -o json "$@" 2>>$OUT/llama.log; }
B="bench/cuda_bench.py /tmp/a3b --skip budget,cold --repeats 3 --lengths 45,1024 --decode 32 --decode-after 45,4096"
for r in 1 2; do
  (cd .ab && timeout $(left) python3 $B --json $OUT/main-$r.json > $OUT/main-$r.log 2>&1); el "main $r"; grep -E "^library|^resident (prefill|decode)" $OUT/main-$r.log
  timeout $(left) python3 $B --json $OUT/this-$r.json > $OUT/this-$r.log 2>&1; el "this $r"; grep -E "^library|^resident (prefill|decode)" $OUT/this-$r.log
  SMOE_CUDA_PDL=2 timeout $(left) python3 $B --json $OUT/pdl2-$r.json > $OUT/pdl2-$r.log 2>&1; el "pdl2 $r"; grep -E "^resident (prefill|decode)" $OUT/pdl2-$r.log
  if [ $r = 1 ]; then lb -fa 0,1 -ub 512,1024 -p 45,256,1024 -n 32 -r 3 > $OUT/llama-1.json; lb -fa 0,1 -p 0 -n 32 -d 4096 -r 3 > $OUT/llama-d-1.json
  else lb -fa 1 -ub 512 -p 45,256,1024 -n 32 -r 3 > $OUT/llama-2.json; lb -fa 1 -p 0 -n 32 -d 4096 -r 3 > $OUT/llama-d-2.json; fi
  el "llama $r"
  if [ $r = 1 ] && [ $(left) -gt 150 ]; then SMOE_CUDA_PDL=2 SMOE_CUDA_MULTI=1 timeout $(left) python3 $B --json $OUT/multi-$r.json > $OUT/multi-$r.log 2>&1; el "pdl2 multi $r"; grep -E "^resident (prefill|decode)" $OUT/multi-$r.log; fi
  [ $(left) -lt 200 ] && break
done
tail -1 $OUT/build-fat.log
[ $(left) -gt 40 ] && SMOE_LIB=/tmp/build-fat/libsmoe.so CUDA_FORCE_PTX_JIT=1 timeout $(left) python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "agrees_with_the_cpu or bit_identical_on_the_gpu" 2>&1 | tail -2 | sed 's/^/fat build, compute_80 PTX JIT-compiled on this GPU: /'
python3 - $OUT/llama-*.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    try: rows = json.load(open(f))
    except Exception as e: print(f, "unreadable", e); continue
    for r in rows:
        t = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}@{r.get('n_depth',0)}"
        print(f.split('/')[-1], t, f"fa={r.get('flash_attn')} ub={r.get('n_ubatch')}", round(r["avg_ts"], 1), "±", round(r.get("stddev_ts", 0), 1))
PY
tail -3 $OUT/llama.log
el end
