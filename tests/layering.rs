//! The library's modules import downward only: this test reads `src/`, collects every
//! `crate::…` and `super::…` path outside comments and unit tests, and checks the graph of
//! top-level modules against the layer order below (and that it has no cycle at all).
//!
//! The order is DESIGN.md's layout: FFI tiers and memory at the bottom; what an op reads or
//! writes (`target`); the lanes that do I/O and never see ops; the op and the messages about
//! it; the reactor that runs ops on lanes; the engine that owns a reactor; files on an engine;
//! batches and checkpoints on files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Lowest first. A module may import its own layer's modules only where the graph stays
/// acyclic, and lower layers freely; never a higher one.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["spdk", "cuda", "ucx"],
    &["buf"],
    &["gds", "plan"],
    &["target"],
    &["lane"],
    // Each backend's lane lives with its FFI tiers (DESIGN.md, layout v3) but plugs in above
    // `lane`: its folder's tiers are one unit, its lane another.
    &["uring", "gds::lane", "spdk::lane"],
    &["op"],
    &["reactor"],
    &["engine"],
    &["file", "agent"],
    &["batch"],
    &["safetensors"],
    &["check"],
];

fn layer_of(unit: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&unit))
}

/// The unit a module belongs to: its top-level module, except a backend's lane
/// (`gds::lane` with the batch queue it drives, `spdk::lane`), which is a unit of its own.
fn unit_of(module: &[String]) -> Option<String> {
    let top = module.first()?;
    match (top.as_str(), module.get(1).map(String::as_str)) {
        ("gds" | "spdk", Some("lane")) | ("gds", Some("batch")) => Some(format!("{top}::lane")),
        _ => Some(top.clone()),
    }
}

/// `src/` of the crate, or `None` (with the reason printed) where this binary runs away from
/// its source tree, as in the GPU bundle: the layering is a property of the source.
fn source_dir() -> Option<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    if src.is_dir() {
        Some(src)
    } else {
        println!(
            "SKIPPED: {} is absent (a binary run away from its source)",
            src.display()
        );
        None
    }
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file: `src/reactor/table.rs` is `["reactor", "table"]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// The paths a line refers to, as segments after `crate::` or resolved from `super::`
/// (one level of braces is expanded: `crate::op::{msg::Msg, OpShared}`).
fn references(line: &str, module: &[String], is_mod_file: bool) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (anchor, base) in [
        ("crate::", Vec::new()),
        ("super::", {
            // In `a/b.rs` (module a::b) `super` is `a`; in `a/mod.rs` (module a) it is the root.
            let mut m = module.to_vec();
            let _ = is_mod_file;
            m.pop();
            m
        }),
    ] {
        let mut rest = line;
        while let Some(i) = rest.find(anchor) {
            // `crate::` inside an identifier (`gpuio_crate::`) is not a path start.
            let before = rest[..i].chars().last();
            rest = &rest[i + anchor.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let mut segs = base.clone();
            let mut tail = rest;
            let mut super_hops = 0;
            while let Some(t) = tail.strip_prefix("super::") {
                super_hops += 1;
                tail = t;
            }
            for _ in 0..super_hops {
                segs.pop();
            }
            let path: String = tail
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':' || *c == '{')
                .collect();
            let (head, group) = match path.find('{') {
                Some(b) => (&path[..b], Some(&tail[b + 1..])),
                None => (path.as_str(), None),
            };
            let head_segs: Vec<String> = head
                .split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
            let mut full = segs.clone();
            full.extend(head_segs);
            match group {
                Some(g) => {
                    let inner: String = g.chars().take_while(|c| *c != '}').collect();
                    for item in inner.split(',') {
                        let mut p = full.clone();
                        p.extend(
                            item.trim()
                                .split("::")
                                .filter(|s| !s.is_empty())
                                .map(str::to_string),
                        );
                        out.push(p);
                    }
                }
                None => out.push(full),
            }
        }
    }
    out
}

#[test]
fn modules_import_downward_only() {
    let Some(src) = source_dir() else { return };
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
    let mut edges: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy();
        // Unit-test modules may reach anywhere (the crate root's re-exports included).
        if name == "tests.rs" || name == "fake.rs" {
            continue;
        }
        let module = module_of(&src, file);
        let Some(unit) = unit_of(&module) else {
            continue; // lib.rs: the root re-exports everything
        };
        let text = std::fs::read_to_string(file).unwrap();
        let mut prev = "";
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if prev.contains("#[cfg(test)]") && code.starts_with("mod tests") {
                break; // in-file unit tests sit at the end
            }
            prev = code;
            if code.starts_with("//") {
                continue;
            }
            for r in references(code, &module, name == "mod.rs") {
                // The longest prefix that is a module file, or the root.
                let target = (0..=r.len())
                    .rev()
                    .map(|k| r[..k].to_vec())
                    .find(|p| modules.contains(p))
                    .unwrap_or_default();
                let to = unit_of(&target).unwrap_or_else(|| "lib".into());
                if to != unit {
                    edges.entry((unit.clone(), to)).or_default().push(format!(
                        "{}:{}",
                        file.display(),
                        n + 1
                    ));
                }
            }
        }
    }
    if std::env::var_os("GPUIO_SHOW_LAYERS").is_some() {
        for (from, to) in edges.keys() {
            println!("{from} -> {to}");
        }
    }
    let mut bad = Vec::new();
    for ((from, to), at) in &edges {
        let ok = match (layer_of(from), layer_of(to)) {
            (Some(f), Some(t)) => t <= f,
            _ => false,
        };
        if !ok {
            bad.push(format!("{from} -> {to} (at {})", at[0]));
        }
    }
    assert!(
        bad.is_empty(),
        "imports that point up, or at modules missing from LAYERS (crate-root re-exports \
         included):\n{}",
        bad.join("\n")
    );
    // Same-layer imports must not close a loop.
    let units: BTreeSet<&String> = edges.keys().flat_map(|(a, b)| [a, b]).collect();
    let mut state: BTreeMap<&String, u8> = BTreeMap::new();
    fn visit<'a>(
        u: &'a String,
        edges: &'a BTreeMap<(String, String), Vec<String>>,
        state: &mut BTreeMap<&'a String, u8>,
        stack: &mut Vec<&'a String>,
    ) {
        match state.get(u) {
            Some(2) => return,
            Some(1) => panic!("import cycle: {:?} -> {u}", stack),
            _ => {}
        }
        state.insert(u, 1);
        stack.push(u);
        for (from, to) in edges.keys() {
            if from == u {
                visit(to, edges, state, stack);
            }
        }
        stack.pop();
        state.insert(u, 2);
    }
    for u in units {
        visit(u, &edges, &mut state, &mut Vec::new());
    }
    // The graph is what DESIGN.md promises of these rooms in particular.
    for (from, to) in edges.keys() {
        assert!(
            !(to == "reactor" && from != "engine"),
            "only the engine reaches into the reactor: {from} -> reactor"
        );
    }
}

/// What the reactor may not name (DESIGN.md, layout v3): it knows `trait Lane`, not the
/// backends behind it, and nothing of CUDA. Every file under `src/reactor/` counts, its unit
/// tests and the fake lane included, comments aside.
const REACTOR_MUST_NOT_NAME: &[&str] = &[
    "feature = \"cuda\"",
    "cudarc",
    "crate::cuda",
    "crate::gds",
    "crate::spdk",
    "crate::uring",
    "CufileLane",
    "SpdkLane",
    "UringLane",
];

#[test]
fn the_reactor_names_no_backend_and_no_cuda() {
    let Some(src) = source_dir() else { return };
    let mut files = Vec::new();
    rust_files(&src.join("reactor"), &mut files);
    assert!(!files.is_empty(), "no files under src/reactor");
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for name in REACTOR_MUST_NOT_NAME {
                if code.contains(name) {
                    found.push(format!("{}:{}: {name}", file.display(), n + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "src/reactor names a backend or CUDA ({} places):\n{}",
        found.len(),
        found.join("\n")
    );
}

/// Every foreign call goes through its backend's checked tier: cuFile's symbols are called in
/// `gds/sys.rs` and `gds/result.rs` only, SPDK's in `spdk/{sys,env,ctrlr}.rs`, UCX's (the
/// `ucp_`/`ucs_` function table) in `ucx/sys.rs` and `ucx/result.rs`, and the CUDA driver's
/// raw (`cudarc::driver::sys`) entry points in `src/cuda/` only. Lanes, ops, agents and the
/// reactor call those tiers' wrappers.
#[test]
fn foreign_calls_stay_in_their_tiers() {
    let Some(src) = source_dir() else { return };
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let rules: &[(&str, &[&str])] = &[
        ("lib.cuFile", &["gds/sys.rs", "gds/result.rs"]),
        (
            "lib.spdk_",
            &["spdk/sys.rs", "spdk/env.rs", "spdk/ctrlr.rs"],
        ),
        (
            "lib().spdk_",
            &["spdk/sys.rs", "spdk/env.rs", "spdk/ctrlr.rs"],
        ),
        ("lib.ucp_", &["ucx/sys.rs", "ucx/result.rs"]),
        ("lib.ucs_", &["ucx/sys.rs", "ucx/result.rs"]),
        ("sys::cu", &["cuda/"]),
        ("cu::cu", &["cuda/"]),
    ];
    let mut bad = Vec::new();
    for file in &files {
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            for (needle, allowed) in rules {
                // `sys::cu` followed by a lower-case letter is a type path (`sys::cuda…`), not a
                // call; calls are `cuXxx`.
                let hit = code.match_indices(needle).any(|(i, _)| {
                    !needle.ends_with("cu")
                        || code[i + needle.len()..]
                            .chars()
                            .next()
                            .is_some_and(|c| c.is_ascii_uppercase())
                });
                if hit && !allowed.iter().any(|a| rel.starts_with(a)) {
                    bad.push(format!("{rel}:{}: {needle}…", n + 1));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "foreign calls outside their tiers:\n{}",
        bad.join("\n")
    );
}
