//! Finds libsmoe to link against, first match wins:
//!   1. SMOE_LIB_DIR, a directory holding libsmoe.so / libsmoe.dylib;
//!   2. `pkg-config --libs-only-L smoe` (after `make install`);
//!   3. this repository's build/ (after `make lib`).
//! The directory is also written into the test binaries' rpath, so `cargo test` runs without
//! LD_LIBRARY_PATH.
use std::path::PathBuf;
use std::process::Command;

fn pkg_config_dir() -> Option<String> {
    let out = Command::new("pkg-config").args(["--libs-only-L", "smoe"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    text.split_whitespace().find_map(|flag| flag.strip_prefix("-L").map(str::to_owned))
}

fn main() {
    println!("cargo:rerun-if-env-changed=SMOE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let dir = std::env::var("SMOE_LIB_DIR").ok().or_else(pkg_config_dir).unwrap_or_else(|| {
        let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
        manifest.join("../../build").display().to_string()
    });
    println!("cargo:rustc-link-search=native={dir}");
    println!("cargo:rustc-link-lib=dylib=smoe");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
}
