//! The binding against the Python one: tests/test_bindings.py writes, from pysmoe on the tiny
//! vault, a prompt and the logits after it and after each following greedy step; this feeds the
//! same ids through the Rust binding and wants the same f32 bits. Run alone (`cargo test`), with
//! SMOE_TEST_VAULT and SMOE_TEST_EXPECTED unset, that comparison says it was skipped.
use smoe::{Error, Vault};

/// The expected file: `prompt ID...`, `chunk N`, then `logits HEX...` (after the prompt) and
/// `decode ID NEXT HEX...` lines (after feeding ID; NEXT the greedy pick), HEX an f32's bits.
struct Expected {
    prompt: Vec<i32>,
    chunk: u32,
    after_prompt: Vec<u32>,
    steps: Vec<(i32, i32, Vec<u32>)>,
}

fn hex_bits(words: &[&str]) -> Vec<u32> {
    words.iter().map(|w| u32::from_str_radix(w, 16).expect("hex f32 bits")).collect()
}

fn read_expected(path: &str) -> Expected {
    let text = std::fs::read_to_string(path).expect("SMOE_TEST_EXPECTED readable");
    let mut e = Expected { prompt: vec![], chunk: 0, after_prompt: vec![], steps: vec![] };
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["prompt", ids @ ..] => e.prompt = ids.iter().map(|w| w.parse().unwrap()).collect(),
            ["chunk", n] => e.chunk = n.parse().unwrap(),
            ["logits", bits @ ..] => e.after_prompt = hex_bits(bits),
            ["decode", id, next, bits @ ..] => e.steps.push((id.parse().unwrap(), next.parse().unwrap(), hex_bits(bits))),
            _ => panic!("unexpected line in {path}: {line}"),
        }
    }
    e
}

fn bits(logits: &[f32]) -> Vec<u32> {
    logits.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn logits_match_python_bit_for_bit() -> Result<(), Error> {
    // (a match, not let-else: Debian's cargo is Rust 1.63)
    let (vault_dir, expected) = match (std::env::var("SMOE_TEST_VAULT"), std::env::var("SMOE_TEST_EXPECTED")) {
        (Ok(v), Ok(e)) => (v, e),
        _ => {
            println!("skipped: SMOE_TEST_VAULT / SMOE_TEST_EXPECTED unset (tests/test_bindings.py sets them)");
            return Ok(());
        }
    };
    let want = read_expected(&expected);
    let vault = Vault::open(&vault_dir)?;
    let mut params = vault.default_params();
    params.chunk = want.chunk;
    let mut session = vault.session_with(&params)?;

    assert_eq!(bits(&session.prefill(&want.prompt)?), want.after_prompt, "logits after the prompt");
    for (i, (id, next, logits)) in want.steps.iter().enumerate() {
        let (got, got_next) = session.step(*id)?;
        assert_eq!(&bits(&got), logits, "logits after decode step {i} (id {id})");
        assert_eq!(got_next, *next, "greedy id after decode step {i}");
    }
    assert_eq!(session.position() as usize, want.prompt.len() + want.steps.len());
    println!(
        "rust: {} logits vectors of {} floats bit-identical to Python's",
        1 + want.steps.len(),
        want.after_prompt.len()
    );
    Ok(())
}

#[test]
fn errors_carry_status_and_message() {
    let err = Vault::open("/nonexistent/vault").err().expect("opening a missing vault fails");
    assert_eq!(err.status, smoe::sys::SMOE_ERR_VAULT);
    assert_eq!(err.to_string(), format!("bad vault: {}", err.message));
    assert!(err.message.contains("/nonexistent/vault"), "message: {}", err.message);
}

#[test]
fn abi_and_version() {
    assert_eq!(unsafe { smoe::sys::smoe_abi_version() }, smoe::ABI_VERSION);
    assert!(!smoe::version().is_empty());
    // The struct this crate declares is the library's (a by-value return writes sizeof of C's).
    let p = unsafe { smoe::sys::smoe_session_default_params() };
    assert_eq!(p.struct_size as usize, std::mem::size_of::<smoe::SessionParams>());
}
