# pysmoe — build the C engine, set up Python, run the demo and the tests.
#
#   make run     build everything, generate from the shipped demo model (pysmoe/data/demo)
#   make test    build everything and run the test suite
#   make lib     only libsmoe (build/libsmoe.so, copied into pysmoe/ for the binding)
#   make install PREFIX=/usr/local [DESTDIR=...]   libsmoe (versioned, with its soname links), smoe.h
#                and smoe.pc for pkg-config; `make uninstall` with the same variables removes them
#   make asan    the test suite against a libsmoe built with AddressSanitizer + UBSan
#   make fuzz    mutate a tiny vault's header and tables under ASan/UBSan (tests/c/fuzz_vault.c), then
#                its blob payloads through the engine, then the Python reader (tests/fuzz_vaultio.py)
#   make neon-check  the C tests cross-built for aarch64 (NEON kernels), run under qemu-aarch64;
#                skipped with a message where the tools are missing (scripts/neon_check.sh)
#   make PORTABLE=1 ...   no instruction-set-specific kernels
#   make CUDA=1 lib       libsmoe with the CUDA backend too (csrc/cuda/, nvcc; builds in build-cuda/
#                and copies that library into pysmoe/); the default build needs no nvcc

PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
UNAME   := $(shell uname -s)
ARCH    := $(shell uname -m)

CC      ?= cc
# -ffp-contract=off: no silent a*b+c fusion, so each reduction's rounding is what the source
# says, the same in the batched and single-token kernels and in numpy's dequantisation.
CFLAGS_BASE := -std=c11 -Wall -Wextra -fPIC -pthread -ffp-contract=off -fvisibility=hidden \
               -D_GNU_SOURCE -D_DARWIN_C_SOURCE -DSMOE_BUILD -Icsrc
OPT     ?= -O3 -g
# libc's checked string and I/O functions, as Ubuntu's gcc turns them on by default: every build
# here compiles against them, so code that cannot take them (cpu.c's baseline region) fails here.
HARDEN  ?= -U_FORTIFY_SOURCE -D_FORTIFY_SOURCE=2
ifeq ($(PORTABLE),1)
  ISA_FLAGS := -DSMOE_PORTABLE=1
else ifeq ($(ARCH),x86_64)
  ISA_FLAGS := -mavx2 -mfma -mf16c
else
  ISA_FLAGS :=
endif
CFLAGS  += $(CFLAGS_BASE) $(OPT) $(HARDEN) $(ISA_FLAGS)
LDLIBS  := -lm -pthread

# The CUDA backend (csrc/cuda/, docs/gpu.md): machine code for the GPUs people own —
# sm_80 (A100), sm_86 (RTX 30xx, A-series), sm_89 (RTX 40xx, L4/L40), sm_90 (H100/H200), and, where
# the toolkit has them, sm_100 (B200) and sm_120 (RTX 50xx) — plus compute_80 PTX, which the driver
# compiles for any newer GPU, so no GPU of compute capability 8.0 or more lacks a kernel (the
# kernels use mma.sync and cp.async: 8.0 is the floor, and share_new refuses an older GPU by name).
# The CUDA runtime linked statically, so the library needs only the driver at run time. CUDA_ARCH
# replaces the targets (one GPU's build is quicker: CUDA_ARCH="-gencode arch=compute_90,code=sm_90").
ifeq ($(CUDA),1)
  BUILD     ?= build-cuda
  NVCC      ?= nvcc
  CUDA_HOME ?= /usr/local/cuda
  NVCC_ARCHS := $(shell $(NVCC) --list-gpu-arch 2>/dev/null)
  CUDA_SMS  := 80 86 89 90 $(if $(filter compute_100,$(NVCC_ARCHS)),100) $(if $(filter compute_120,$(NVCC_ARCHS)),120)
  CUDA_ARCH ?= $(foreach sm,$(CUDA_SMS),-gencode arch=compute_$(sm),code=sm_$(sm)) \
               -gencode arch=compute_80,code=compute_80
  NVCCFLAGS ?= -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -fPIC,-fvisibility=hidden,-Wall,-Wextra
  CFLAGS    += -DSMOE_CUDA=1
  LDLIBS    += -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/lib -lcudart_static -lstdc++ -ldl -lrt
endif

# The shared object's version is ABI.MINOR.PATCH: its first number (the soname's) is
# SMOE_ABI_VERSION, so a program linked against one ABI never loads another; MINOR.PATCH are the
# release's (SMOE_VERSION_STRING). Both are read from smoe.h, the one place they are set.
ABI     := $(shell sed -n 's/^.define SMOE_ABI_VERSION \([0-9][0-9]*\).*/\1/p' csrc/smoe.h)
RELEASE := $(shell sed -n 's/^.define SMOE_VERSION_STRING "\([0-9.]*\)".*/\1/p' csrc/smoe.h)
SOVERSION := $(ABI).$(word 2,$(subst ., ,$(RELEASE))).$(word 3,$(subst ., ,$(RELEASE)))

PREFIX     ?= /usr/local
LIBDIR     ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig

# LIBNAME is what -lsmoe finds (a link); LIBSONAME what a linked program asks the loader for
# (a link); LIBREAL the file itself. HERE: an rpath entry meaning "beside the executable".
ifeq ($(UNAME),Darwin)
  LIBNAME   := libsmoe.dylib
  LIBSONAME := libsmoe.$(ABI).dylib
  LIBREAL   := $(LIBSONAME)
  SHARED     = -dynamiclib -install_name $(1)/$(LIBSONAME) \
               -compatibility_version $(ABI) -current_version $(SOVERSION)
  BUILD_ID  := @rpath
  HERE      := @loader_path
else
  LIBNAME   := libsmoe.so
  LIBSONAME := libsmoe.so.$(ABI)
  LIBREAL   := libsmoe.so.$(SOVERSION)
  # -z nodelete: a host that unloads the library (dlclose; cffi's and ctypes' libraries at the
  # interpreter's exit) must not unmap code that the vault's reader, the streamer's or the pool's
  # threads still run (a segfault at exit otherwise). On macOS the Objective-C (Metal) image is
  # never unloaded.
  SHARED     = -shared -Wl,-soname,$(LIBSONAME) -Wl,-z,nodelete
  BUILD_ID  :=
  HERE      := $$ORIGIN
endif

# The library's C files: the vault, the streamer and the seam at the top of csrc/, the engine above
# the seam (csrc/engine/), the CPU backend below it (csrc/cpu/); csrc/cuda/ with CUDA=1.
SRCS    := $(sort $(wildcard csrc/*.c csrc/engine/*.c csrc/cpu/*.c))
HDRS    := $(wildcard csrc/*.h csrc/engine/*.h csrc/cpu/*.h)
BUILD   ?= build
OBJS    := $(patsubst csrc/%.c,$(BUILD)/%.o,$(SRCS))
ifeq ($(CUDA),1)
  CUDA_SRCS := $(sort $(wildcard csrc/cuda/*.c))
  CUDA_CU   := $(sort $(wildcard csrc/cuda/*.cu))
  OBJS    += $(patsubst csrc/%.c,$(BUILD)/%.o,$(CUDA_SRCS)) $(patsubst csrc/%.cu,$(BUILD)/%.cu.o,$(CUDA_CU))
endif
LIB     := $(BUILD)/$(LIBNAME)
EXAMPLE := $(BUILD)/smoe_generate

.PHONY: all lib examples venv venv-test run test asan clean fuzz neon-check install uninstall

all: lib examples

lib: $(LIB) pysmoe/$(LIBNAME)

$(BUILD)/%.o: csrc/%.c $(HDRS) $(wildcard csrc/cuda/*.h) | $(BUILD)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD):
	mkdir -p $(BUILD)

$(BUILD)/cuda/%.cu.o: csrc/cuda/%.cu $(wildcard csrc/cuda/*.h csrc/cuda/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(BUILD)/$(LIBREAL): $(OBJS)
	$(CC) $(CFLAGS) $(call SHARED,$(BUILD_ID)) -o $@ $(OBJS) $(LDLIBS)

ifneq ($(LIBSONAME),$(LIBREAL))
$(BUILD)/$(LIBSONAME): $(BUILD)/$(LIBREAL)
	ln -sf $(LIBREAL) $@
endif

$(LIB): $(BUILD)/$(LIBSONAME)
	ln -sf $(LIBSONAME) $@

# Copy, then rename: a running process keeps the old file's pages (cp would rewrite them under it).
# Compared rather than dated, so that `make lib` after `make CUDA=1 lib` (or back) puts that
# build's library in place even when the other one's copy is newer.
.PHONY: pysmoe/$(LIBNAME)
pysmoe/$(LIBNAME): $(LIB)
	cmp -s $(LIB) $@ || { cp $(LIB) $@.tmp && mv -f $@.tmp $@; }

examples: $(EXAMPLE)

# The example links only libsmoe (rpath next to itself).
EXAMPLE_CFLAGS ?= -O2
$(EXAMPLE): examples/generate.c csrc/smoe.h $(LIB)
	$(CC) -std=c11 -Wall -Wextra $(EXAMPLE_CFLAGS) -Icsrc $< -L$(BUILD) -lsmoe -Wl,-rpath,'$(HERE)' -o $@

# --- Installing. On macOS the library is linked again with its install_name (the absolute path
# where it will live, DESTDIR left out) rather than patched with install_name_tool, which would
# invalidate its signature; on Linux the built file is installed as it is (no rpath in it).
# Run ldconfig after installing into a system directory; a staged DESTDIR install does not.
ifeq ($(UNAME),Darwin)
INSTALL_LIB := $(BUILD)/install/$(LIBREAL)
$(INSTALL_LIB): $(OBJS)
	mkdir -p $(BUILD)/install
	$(CC) $(CFLAGS) $(call SHARED,$(LIBDIR)) -o $@ $(OBJS) $(LDLIBS)
.PHONY: $(INSTALL_LIB)
else
INSTALL_LIB := $(BUILD)/$(LIBREAL)
endif

install: $(INSTALL_LIB) csrc/smoe.h smoe.pc.in
	install -d $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(PKGCONFIGDIR)
	install -m 755 $(INSTALL_LIB) $(DESTDIR)$(LIBDIR)/$(LIBREAL)
	$(if $(filter-out $(LIBREAL),$(LIBSONAME)),ln -sf $(LIBREAL) $(DESTDIR)$(LIBDIR)/$(LIBSONAME))
	ln -sf $(LIBSONAME) $(DESTDIR)$(LIBDIR)/$(LIBNAME)
	install -m 644 csrc/smoe.h $(DESTDIR)$(INCLUDEDIR)/smoe.h
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(LIBDIR)|' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|' \
	    -e 's|@VERSION@|$(RELEASE)|' smoe.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/smoe.pc
	chmod 644 $(DESTDIR)$(PKGCONFIGDIR)/smoe.pc

uninstall:
	rm -f $(DESTDIR)$(LIBDIR)/$(LIBREAL) $(DESTDIR)$(LIBDIR)/$(LIBSONAME) $(DESTDIR)$(LIBDIR)/$(LIBNAME) \
	      $(DESTDIR)$(INCLUDEDIR)/smoe.h $(DESTDIR)$(PKGCONFIGDIR)/smoe.pc

# --- Python environment: created here, so a fresh machine needs only python3 and a compiler.
# An editable install with the server's extra (setup.py's build hook runs `make lib` for it).
$(VENV)/.stamp-base: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[serve]'
	touch $@

$(VENV)/.stamp-test: pyproject.toml setup.py $(VENV)/.stamp-base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.stamp-base
venv-test: $(VENV)/.stamp-test

run: lib $(VENV)/.stamp-base
	$(PY) -m pysmoe run --prompt "The quick brown fox" --max-tokens 32

test: lib examples $(VENV)/.stamp-test
	$(PY) -m pytest -q tests

# Sanitizers: the library is built apart (build-asan/) and loaded into the ordinary Python by
# preloading the sanitizer runtimes; leak checking is off because CPython itself leaks by design.
ASAN_BUILD := build-asan
asan: $(VENV)/.stamp-test
	$(MAKE) BUILD=$(ASAN_BUILD) OPT="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined" \
	        LDLIBS="-lm -pthread -fsanitize=address,undefined" EXAMPLE_CFLAGS="-O1 -g -fsanitize=address,undefined" \
	        $(ASAN_BUILD)/$(LIBNAME) $(ASAN_BUILD)/smoe_generate
	SMOE_LIB=$(CURDIR)/$(ASAN_BUILD)/$(LIBNAME) SMOE_EXAMPLE=$(CURDIR)/$(ASAN_BUILD)/smoe_generate \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libubsan.so)" \
	$(PY) -m pytest -q -x tests -m "not slow" -p no:cacheprovider

# The parser fuzzer as its own mutation driver (gcc has no libFuzzer; the file says how to build
# it with clang's -fsanitize=fuzzer); it goes on to blob payloads. Then the Python reader. Both
# write only under FUZZ_OUT: their temporary vaults, and the input a failure died on. A UBSan
# report stops the run, as an ASan one does. tests/test_fuzz.py builds the same driver
# without sanitizers (its own FUZZ_DRIVER path, FUZZ_CFLAGS=-O1) for a short run in `make test`.
FUZZ_ITERS  ?= 200000
FUZZ_OUT    ?= $(BUILD)/fuzz
FUZZ_DRIVER ?= $(BUILD)/fuzz_vault
FUZZ_CFLAGS ?= -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined
.PHONY: $(FUZZ_DRIVER)
$(FUZZ_DRIVER):
	mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) $(ISA_FLAGS) $(FUZZ_CFLAGS) -DSTANDALONE -Icsrc \
	      tests/c/fuzz_vault.c $(SRCS) $(LDLIBS) -o $@
fuzz: lib $(VENV)/.stamp-base $(FUZZ_DRIVER)
	mkdir -p $(FUZZ_OUT)
	# a seed this library cannot open (missing, or an older vault format) is made anew
	$(PY) -c "import pysmoe; pysmoe.open_vault('$(BUILD)/fuzz-seed').close()" 2>/dev/null || \
	  $(PY) -m pysmoe synth $(BUILD)/fuzz-seed --preset tiny --force
	# and a vault of another family (vault v3's parameters, biases, shared experts: GLM-4.5's recipe)
	$(PY) -c "import pysmoe; pysmoe.open_vault('$(BUILD)/fuzz-seed-glm').close()" 2>/dev/null || \
	  $(PY) -m pysmoe synth $(BUILD)/fuzz-seed-glm --preset tiny-glm --force
	# and a hybrid (Gated DeltaNet layers, the linear_* parameters), imported from its GGUF fixture
	$(PY) -c "import pysmoe; pysmoe.open_vault('$(BUILD)/fuzz-seed-q35').close()" 2>/dev/null || \
	  $(PY) -m pysmoe convert tests/data/gguf/qwen35moe-q8_0.gguf $(BUILD)/fuzz-seed-q35 --force
	$(FUZZ_DRIVER) $(FUZZ_ITERS) $(FUZZ_OUT) $(BUILD)/fuzz-seed/vault.bin $(BUILD)/fuzz-seed-glm/vault.bin \
	  $(BUILD)/fuzz-seed-q35/vault.bin
	PYTHONPATH=$(CURDIR) $(PY) tests/fuzz_vaultio.py $$(( $(FUZZ_ITERS) / 20 )) $(BUILD)/fuzz-seed $(FUZZ_OUT)
	PYTHONPATH=$(CURDIR) $(PY) tests/fuzz_vaultio.py $$(( $(FUZZ_ITERS) / 20 )) $(BUILD)/fuzz-seed-glm $(FUZZ_OUT)
	PYTHONPATH=$(CURDIR) $(PY) tests/fuzz_vaultio.py $$(( $(FUZZ_ITERS) / 20 )) $(BUILD)/fuzz-seed-q35 $(FUZZ_OUT)

# Not part of `make test`: it needs a cross compiler and qemu-user (apt), which CI does not install.
neon-check:
	OUT=$(BUILD)/neon-check PY=$(PY) sh scripts/neon_check.sh

clean:
	rm -rf $(BUILD) build-cuda $(ASAN_BUILD) pysmoe/libsmoe.so pysmoe/libsmoe.dylib
