//! The raw C ABI of csrc/smoe.h, written out by hand: only what the safe wrapper uses.
//!
//! The structs mirror the header's for SMOE_ABI_VERSION 6 (`crate::ABI_VERSION`); the wrapper
//! refuses a library of another ABI before it calls anything that passes them, and
//! tests/test_bindings.py fails when smoe.h's SMOE_ABI_VERSION and this crate's drift apart.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int};

pub type smoe_status = c_int;
pub const SMOE_OK: smoe_status = 0;
pub const SMOE_ERR_INVALID_ARG: smoe_status = -1;
pub const SMOE_ERR_VAULT: smoe_status = -4;

#[repr(C)]
pub struct smoe_vault {
    _opaque: [u8; 0],
}

#[repr(C)]
pub struct smoe_session {
    _opaque: [u8; 0],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct smoe_config {
    pub struct_size: u32,
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub num_hidden_layers: u32,
    pub num_attention_heads: u32,
    pub num_key_value_heads: u32,
    pub head_dim: u32,
    pub intermediate_size: u32,
    pub moe_intermediate_size: u32,
    pub num_experts: u32,
    pub num_experts_per_tok: u32,
    pub max_position_embeddings: u32,
    pub num_sparse_layers: u32,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub blob_bytes: u64,
    pub dense_bytes: u64,
    pub file_bytes: u64,
    pub norm_topk_prob: bool,
    pub tie_word_embeddings: bool,
    pub paged_bytes: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct smoe_session_params {
    pub struct_size: u32,
    pub context: u32,
    pub chunk: u32,
    pub threads: u32,
    pub io_threads: u32,
    pub kv_dtype: u32,
    pub device: u32,
    pub cache_bytes: u64,
    pub coalesce_bytes: u64,
    pub gpu_cache_bytes: u64,
    pub direct_io: bool,
    pub verify_blobs: bool,
    pub float_activations: bool,
    pub part_rows: u32,
}

extern "C" {
    pub fn smoe_status_str(status: smoe_status) -> *const c_char;
    pub fn smoe_last_error() -> *const c_char;
    pub fn smoe_version() -> *const c_char;
    pub fn smoe_abi_version() -> c_int;

    pub fn smoe_open_vault(dir: *const c_char, out: *mut *mut smoe_vault) -> smoe_status;
    pub fn smoe_close_vault(vault: *mut smoe_vault);
    pub fn smoe_vault_config(vault: *const smoe_vault, out: *mut smoe_config) -> smoe_status;

    pub fn smoe_session_default_params() -> smoe_session_params;
    pub fn smoe_session_new(
        vault: *mut smoe_vault,
        params: *const smoe_session_params,
        out: *mut *mut smoe_session,
    ) -> smoe_status;
    pub fn smoe_session_free(session: *mut smoe_session);
    pub fn smoe_session_reset(session: *mut smoe_session) -> smoe_status;
    pub fn smoe_session_position(session: *const smoe_session) -> u32;
    pub fn smoe_prefill_chunk(
        session: *mut smoe_session,
        ids: *const i32,
        n: u32,
        logits: *mut f32,
        next_id: *mut i32,
    ) -> smoe_status;
    pub fn smoe_decode_step(session: *mut smoe_session, id: i32, logits: *mut f32, next_id: *mut i32)
        -> smoe_status;
    pub fn smoe_session_set_mask(session: *mut smoe_session, bitmask: *const u32, n_words: u32) -> smoe_status;
}
