// Package smoe binds libsmoe, the pysmoe engine (csrc/smoe.h), through cgo.
//
//	vault, err := smoe.Open("path/to/vault")
//	defer vault.Close()
//	session, err := vault.NewSession(vault.DefaultParams())
//	defer session.Close()
//	logits, err := session.Prefill([]int32{1, 2, 3}) // logits of the last id
//
// By default it builds against this repository's csrc/smoe.h and build/libsmoe.so (`make lib`);
// for an installed libsmoe, set CGO_CFLAGS="$(pkg-config --cflags smoe)" and
// CGO_LDFLAGS="$(pkg-config --libs smoe)". Errors are *Error, carrying the smoe_status and the
// library's own message. A Session runs one call at a time (concurrent calls get SMOE_ERR_BUSY);
// Close a session before its vault.
package smoe

/*
#cgo CFLAGS: -I${SRCDIR}/../../csrc
#cgo LDFLAGS: -L${SRCDIR}/../../build -lsmoe -Wl,-rpath,${SRCDIR}/../../build
#include <stdlib.h>
#include "smoe.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Error is a failed libsmoe call: its status (negative) and the library's message.
type Error struct {
	Status  int
	Message string
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s", C.GoString(C.smoe_status_str(C.smoe_status(e.Status))), e.Message)
}

// check reads smoe_last_error on the thread that made the call: the caller holds
// runtime.LockOSThread across both, since the message is thread-local in C.
func check(st C.smoe_status) error {
	if st == C.SMOE_OK {
		return nil
	}
	return &Error{Status: int(st), Message: C.GoString(C.smoe_last_error())}
}

// Version is libsmoe's version string.
func Version() string { return C.GoString(C.smoe_version()) }

// Config is the model's shape: some fields of smoe_config.
type Config struct {
	VocabSize, HiddenSize, NumHiddenLayers, NumExperts, NumExpertsPerTok, MaxPositionEmbeddings uint32
}

// Params are session options (smoe_session_params): Context, Chunk, Threads, CacheBytes, ...
type Params struct {
	Context, Chunk, Threads, IOThreads uint32
	CacheBytes                         uint64
	DirectIO, VerifyBlobs              bool
	FloatActivations                   bool
}

// Vault is an open vault: dense weights in memory, expert blobs on disk.
type Vault struct {
	raw   *C.smoe_vault
	vocab int
}

// Open opens the vault directory dir after checking that the library's ABI is the header's.
func Open(dir string) (*Vault, error) {
	if abi := int(C.smoe_abi_version()); abi != C.SMOE_ABI_VERSION {
		return nil, &Error{Status: C.SMOE_ERR_INVALID_ARG,
			Message: fmt.Sprintf("libsmoe has ABI version %d, this package was built for %d", abi, C.SMOE_ABI_VERSION)}
	}
	cdir := C.CString(dir)
	defer C.free(unsafe.Pointer(cdir))
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	v := &Vault{}
	if err := check(C.smoe_open_vault(cdir, &v.raw)); err != nil {
		return nil, err
	}
	cfg, err := v.Config()
	if err != nil {
		v.Close()
		return nil, err
	}
	v.vocab = int(cfg.VocabSize)
	return v, nil
}

// Close closes the vault (after every session of it is closed); a second Close does nothing.
func (v *Vault) Close() {
	C.smoe_close_vault(v.raw)
	v.raw = nil
}

// Config is the vault's model configuration.
func (v *Vault) Config() (Config, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var c C.smoe_config
	c.struct_size = C.uint32_t(unsafe.Sizeof(c))
	if err := check(C.smoe_vault_config(v.raw, &c)); err != nil {
		return Config{}, err
	}
	return Config{VocabSize: uint32(c.vocab_size), HiddenSize: uint32(c.hidden_size),
		NumHiddenLayers: uint32(c.num_hidden_layers), NumExperts: uint32(c.num_experts),
		NumExpertsPerTok: uint32(c.num_experts_per_tok), MaxPositionEmbeddings: uint32(c.max_position_embeddings)}, nil
}

// DefaultParams are the library's defaults (smoe_session_default_params).
func (v *Vault) DefaultParams() Params {
	p := C.smoe_session_default_params()
	return Params{Context: uint32(p.context), Chunk: uint32(p.chunk), Threads: uint32(p.threads),
		IOThreads: uint32(p.io_threads), CacheBytes: uint64(p.cache_bytes), DirectIO: bool(p.direct_io),
		VerifyBlobs: bool(p.verify_blobs), FloatActivations: bool(p.float_activations)}
}

// Session is a KV cache and the planes to run one sequence.
type Session struct {
	raw    *C.smoe_session
	chunk  int
	logits []float32
}

// NewSession makes a session of v with params.
func (v *Vault) NewSession(params Params) (*Session, error) {
	p := C.smoe_session_default_params()
	p.context, p.chunk, p.threads = C.uint32_t(params.Context), C.uint32_t(params.Chunk), C.uint32_t(params.Threads)
	p.io_threads, p.cache_bytes = C.uint32_t(params.IOThreads), C.uint64_t(params.CacheBytes)
	p.direct_io, p.verify_blobs = C.bool(params.DirectIO), C.bool(params.VerifyBlobs)
	p.float_activations = C.bool(params.FloatActivations)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	s := &Session{chunk: int(params.Chunk), logits: make([]float32, v.vocab)}
	if err := check(C.smoe_session_new(v.raw, &p, &s.raw)); err != nil {
		return nil, err
	}
	if s.chunk < 1 {
		s.chunk = 1
	}
	return s, nil
}

// Close frees the session; a second Close does nothing.
func (s *Session) Close() {
	C.smoe_session_free(s.raw)
	s.raw = nil
}

// Prefill feeds ids at the current position, layer-major in chunks of the session's chunk; the
// last chunk hands back the logits after the last id (bit for bit those of feeding every id
// through the token-serial step).
func (s *Session) Prefill(ids []int32) ([]float32, error) {
	if len(ids) == 0 {
		return nil, &Error{Status: C.SMOE_ERR_INVALID_ARG, Message: "prefill of no ids"}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for start := 0; start < len(ids); start += s.chunk {
		end := start + s.chunk
		var out *C.float
		if end >= len(ids) {
			end = len(ids)
			out = (*C.float)(unsafe.Pointer(&s.logits[0]))
		}
		if err := check(C.smoe_prefill_chunk(s.raw, (*C.int32_t)(unsafe.Pointer(&ids[start])), C.uint32_t(end-start), out, nil)); err != nil {
			return nil, err
		}
	}
	return append([]float32(nil), s.logits...), nil
}

// Step appends id (one token-serial step) and returns the next-token logits (a new slice) and
// the id the session's sampler picks (greedy by default).
func (s *Session) Step(id int32) ([]float32, int32, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var next C.int32_t
	if err := check(C.smoe_decode_step(s.raw, C.int32_t(id), (*C.float)(unsafe.Pointer(&s.logits[0])), &next)); err != nil {
		return nil, -1, err
	}
	return append([]float32(nil), s.logits...), int32(next), nil
}

// Position is the number of tokens in the KV cache.
func (s *Session) Position() uint32 { return uint32(C.smoe_session_position(s.raw)) }

// Reset forgets the tokens seen so far; the retention cache stays warm.
func (s *Session) Reset() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return check(C.smoe_session_reset(s.raw))
}
