#!/bin/bash
# llama.cpp's CUDA build (llama-bench and its libraries) made on a machine WITHOUT a GPU, packed to
# carry to a GPU machine (device time is scarce: the build takes 6-7 min of 16 cores there):
#   bash scripts/llama_cuda_local.sh SRC.tar.gz OUT.tar.xz [SM]      (SM: default 90)
# SRC.tar.gz  llama.cpp's source tree at its top level (vendor/llama.cpp of the llama-cpp-python
#             sdist without docs/, models/, media/)
# Needs nvcc (CUDA 13) and cmake + ninja here; cuBLAS comes from the nvidia-cublas wheel (pip), and
# the link against the driver API uses a stub libcuda.so.1 made from cuda.h (the real one is the GPU
# machine's). ggml's CPU part is built for AVX-512 + VNNI + BF16 without AMX (the H200 machines' hosts:
# Sapphire Rapids class), so that --n-cpu-moe runs are llama.cpp at its best there. ~20 min on 2 cores.
# On the GPU machine: tar xJf OUT.tar.xz -C /tmp; LD_LIBRARY_PATH=/tmp/llbin:<dirs of libcublas.so.13,
# libcudart.so.13> /tmp/llbin/llama-bench ... (scripts/llama_cuda_device.sh does the rest).
set -euo pipefail
SRC=$1 OUTF=$2 SM=${3:-90}
W=${LLAMA_WORK:-/tmp/llama-cuda-local}
CUDA=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$W"
# cuBLAS headers and libraries into the toolkit, where CMake's FindCUDAToolkit looks
if [ ! -e "$CUDA/lib64/libcublas.so" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$W/whl" "nvidia-cublas>=13,<14"
    rm -rf "$W/cublas" && mkdir -p "$W/cublas" && (cd "$W/cublas" && python3 -m zipfile -e "$W"/whl/nvidia_cublas-*.whl .)
    cp -n "$W"/cublas/nvidia/cu13/include/*.h "$CUDA/include/"
    cp -n "$W"/cublas/nvidia/cu13/lib/*.so.13 "$CUDA/lib64/"
    ln -sf libcublas.so.13 "$CUDA/lib64/libcublas.so"
    ln -sf libcublasLt.so.13 "$CUDA/lib64/libcublasLt.so"
fi
# a stub of the driver API (every cu* function cuda.h declares), only to link against
if [ ! -e "$CUDA/lib64/stubs/libcuda.so.1" ]; then
    mkdir -p "$CUDA/lib64/stubs"
    echo '#include <cuda.h>' | gcc -E -I"$CUDA/include" -x c - | grep -oE '\bcu[A-Z][A-Za-z0-9_]* *\(' | tr -d ' (' |
        sort -u | awk '{print "void " $1 "(void) {}"}' >"$W/stub.c"
    gcc -shared -fPIC -o "$CUDA/lib64/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$W/stub.c"
    ln -sf libcuda.so "$CUDA/lib64/stubs/libcuda.so.1"
fi
rm -rf "$W/src" && mkdir -p "$W/src" && tar xzf "$SRC" -C "$W/src"
cmake -S "$W/src" -B "$W/build" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$SM" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON >"$W/configure.log"
LD_LIBRARY_PATH="$CUDA/lib64/stubs" cmake --build "$W/build" --target llama-bench -j "$(nproc)" >"$W/build.log"
rm -rf "$W/llbin" && mkdir -p "$W/llbin"
cp -a "$W"/build/bin/llama-bench "$W"/build/bin/lib*.so* "$W/llbin/"
strip --strip-unneeded "$W"/llbin/llama-bench "$W"/llbin/lib*.so.*[0-9]
tar cf - -C "$W" llbin | xz -9 -T0 >"$OUTF"
ls -la "$OUTF"
