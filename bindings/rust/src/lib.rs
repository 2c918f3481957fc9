//! Safe Rust binding of libsmoe, the pysmoe engine (csrc/smoe.h).
//!
//! ```no_run
//! let vault = smoe::Vault::open("path/to/vault")?;
//! let mut session = vault.session()?;
//! let logits = session.prefill(&[1, 2, 3])?; // logits of the last id
//! let (_logits, next) = session.step(3)?;     // one token-serial step; greedy next id
//! # Ok::<(), smoe::Error>(())
//! ```
//!
//! A [`Session`] borrows its [`Vault`], so the vault outlives its sessions as the C ABI requires;
//! both free their C objects on `Drop`. Every failure is an [`Error`] carrying the `smoe_status`
//! and the library's own message (`smoe_last_error`). A session runs one call at a time, which
//! `&mut self` already enforces; sessions may move between threads, and a vault may be shared.
pub mod sys;

use std::ffi::{CStr, CString};
use std::fmt;
use std::marker::PhantomData;
use std::path::Path;
use std::ptr::{self, NonNull};

/// The SMOE_ABI_VERSION this crate was written for; [`Vault::open`] refuses any other library.
pub const ABI_VERSION: i32 = 6;

/// A failed libsmoe call: its status (`smoe_status`, negative) and the library's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: i32,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The error of the call that just returned `status` on this thread.
    fn last(status: sys::smoe_status) -> Error {
        // SAFETY: smoe_last_error returns a NUL-terminated string owned by the library, valid
        // until the next failing call on this thread; it is copied at once.
        let message = unsafe { CStr::from_ptr(sys::smoe_last_error()) }.to_string_lossy().into_owned();
        Error { status, message }
    }

    fn invalid(message: String) -> Error {
        Error { status: sys::SMOE_ERR_INVALID_ARG, message }
    }

    /// The status in words (smoe_status_str), e.g. "bad vault".
    pub fn status_text(&self) -> String {
        // SAFETY: smoe_status_str returns a static string for any value.
        unsafe { CStr::from_ptr(sys::smoe_status_str(self.status)) }.to_string_lossy().into_owned()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status_text(), self.message)
    }
}

impl std::error::Error for Error {}

fn check(status: sys::smoe_status) -> Result<()> {
    if status == sys::SMOE_OK {
        Ok(())
    } else {
        Err(Error::last(status))
    }
}

/// libsmoe's version string, e.g. "0.1.0".
pub fn version() -> String {
    // SAFETY: a static NUL-terminated string.
    unsafe { CStr::from_ptr(sys::smoe_version()) }.to_string_lossy().into_owned()
}

#[cfg(unix)]
fn path_bytes(path: &Path) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    path.as_os_str().as_bytes().to_vec()
}

#[cfg(not(unix))]
fn path_bytes(path: &Path) -> Vec<u8> {
    path.to_string_lossy().into_owned().into_bytes()
}

/// The model's shape, as the vault's config.json had it.
pub type Config = sys::smoe_config;
/// Session options (context, chunk, threads, cache budget, ...); see smoe_session_params.
pub type SessionParams = sys::smoe_session_params;

/// An open vault: the dense weights in memory, the expert blobs on disk.
pub struct Vault {
    raw: NonNull<sys::smoe_vault>,
}

// SAFETY: smoe.h: a vault may be shared by several sessions, each used from any thread; the
// only call that changes it, smoe_close_vault, runs in Drop, after every borrowing Session.
unsafe impl Send for Vault {}
unsafe impl Sync for Vault {}

impl Vault {
    /// Opens the vault directory `dir` (smoe_open_vault), after checking the library's ABI.
    pub fn open<P: AsRef<Path>>(dir: P) -> Result<Vault> {
        // SAFETY: takes no arguments.
        let abi = unsafe { sys::smoe_abi_version() };
        if abi != ABI_VERSION {
            return Err(Error::invalid(format!(
                "libsmoe has ABI version {abi}, this crate needs {ABI_VERSION}"
            )));
        }
        let path = dir.as_ref();
        let c_path = CString::new(path_bytes(path))
            .map_err(|_| Error::invalid(format!("{}: path holds a NUL byte", path.display())))?;
        let mut raw = ptr::null_mut();
        // SAFETY: c_path is NUL-terminated; raw receives the handle or NULL.
        check(unsafe { sys::smoe_open_vault(c_path.as_ptr(), &mut raw) })?;
        Ok(Vault { raw: NonNull::new(raw).expect("smoe_open_vault returned SMOE_OK and no vault") })
    }

    pub fn config(&self) -> Result<Config> {
        let mut cfg = Config { struct_size: std::mem::size_of::<Config>() as u32, ..Default::default() };
        // SAFETY: cfg is a smoe_config whose struct_size is its own size.
        check(unsafe { sys::smoe_vault_config(self.raw.as_ptr(), &mut cfg) })?;
        Ok(cfg)
    }

    /// The library's defaults (smoe_session_default_params), to edit and pass to `session_with`.
    pub fn default_params(&self) -> SessionParams {
        // SAFETY: the ABI was checked in open, so the returned struct has this layout.
        unsafe { sys::smoe_session_default_params() }
    }

    /// A session with the default parameters.
    pub fn session(&self) -> Result<Session<'_>> {
        self.session_with(&self.default_params())
    }

    pub fn session_with(&self, params: &SessionParams) -> Result<Session<'_>> {
        let vocab = self.config()?.vocab_size as usize;
        let mut raw = ptr::null_mut();
        // SAFETY: the vault is open, params a valid smoe_session_params; raw receives the handle.
        check(unsafe { sys::smoe_session_new(self.raw.as_ptr(), params, &mut raw) })?;
        let raw = NonNull::new(raw).expect("smoe_session_new returned SMOE_OK and no session");
        Ok(Session { raw, chunk: params.chunk.max(1) as usize, vocab, _vault: PhantomData })
    }
}

impl Drop for Vault {
    fn drop(&mut self) {
        // SAFETY: every Session borrows the vault, so none is left.
        unsafe { sys::smoe_close_vault(self.raw.as_ptr()) }
    }
}

/// A KV cache and the planes to run one sequence; it lives no longer than its vault.
pub struct Session<'v> {
    raw: NonNull<sys::smoe_session>,
    chunk: usize,
    vocab: usize,
    _vault: PhantomData<&'v Vault>,
}

// SAFETY: smoe.h: a session may be used from any thread, one call at a time (&mut self).
unsafe impl Send for Session<'_> {}

impl Session<'_> {
    /// Feeds `ids` at the current position, layer-major in chunks of the session's `chunk`; the
    /// last chunk hands back the logits after the last id (bit for bit those of feeding every id
    /// through the token-serial step). On failure the position is where the failing call found it.
    pub fn prefill(&mut self, ids: &[i32]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::invalid("prefill of no ids".into()));
        }
        let mut logits = vec![0.0f32; self.vocab];
        let chunks = ids.chunks(self.chunk).count();
        for (i, chunk) in ids.chunks(self.chunk).enumerate() {
            let out = if i + 1 == chunks { logits.as_mut_ptr() } else { std::ptr::null_mut() };
            // SAFETY: chunk is a live slice of chunk.len() ≤ params.chunk ids; out, when not null,
            // has room for vocab_size floats.
            check(unsafe {
                sys::smoe_prefill_chunk(self.raw.as_ptr(), chunk.as_ptr(), chunk.len() as u32, out, std::ptr::null_mut())
            })?;
        }
        Ok(logits)
    }

    /// One token-serial step (smoe_decode_step): appends `id`, returns the next-token logits
    /// and the id the session's sampler picks (greedy by default).
    pub fn step(&mut self, id: i32) -> Result<(Vec<f32>, i32)> {
        let mut logits = vec![0.0f32; self.vocab];
        let next = self.step_into(id, &mut logits)?;
        Ok((logits, next))
    }

    /// As `step`, writing the logits into `logits` (at least vocab_size long).
    pub fn step_into(&mut self, id: i32, logits: &mut [f32]) -> Result<i32> {
        if logits.len() < self.vocab {
            return Err(Error::invalid(format!("logits has {} floats, vocab_size is {}", logits.len(), self.vocab)));
        }
        let mut next = -1;
        // SAFETY: logits has room for vocab_size floats, next for one id.
        check(unsafe { sys::smoe_decode_step(self.raw.as_ptr(), id, logits.as_mut_ptr(), &mut next) })?;
        Ok(next)
    }

    /// Tokens in the KV cache.
    pub fn position(&self) -> u32 {
        // SAFETY: the session is live.
        unsafe { sys::smoe_session_position(self.raw.as_ptr()) }
    }

    /// Forgets the tokens seen so far; the retention cache stays warm.
    pub fn reset(&mut self) -> Result<()> {
        // SAFETY: the session is live.
        check(unsafe { sys::smoe_session_reset(self.raw.as_ptr()) })
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        // SAFETY: no call can be running: every call takes &mut self.
        unsafe { sys::smoe_session_free(self.raw.as_ptr()) }
    }
}
