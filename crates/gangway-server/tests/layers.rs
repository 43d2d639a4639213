//! The server's layering, checked on its sources: the state layer (the
//! control state and what it is made of) knows nothing of HTTP. The API,
//! dashboard and metrics depend on it, never the reverse. A state module that
//! imports an HTTP module (or axum) fails this test, which names the file.
//! See docs/ARCHITECTURE.md ("Layers of the server").

use std::path::{Path, PathBuf};

/// The state layer: files (relative to `src/`) that must not import HTTP.
const STATE: &[&str] = &[
    "admission.rs",
    "attempt.rs",
    "audit.rs",
    "authz.rs",
    "backup.rs",
    "blame.rs",
    "clock.rs",
    "config.rs",
    "control.rs",
    "control/",
    "control_error.rs",
    "counted_store.rs",
    "heartbeats.rs",
    "history.rs",
    "limits.rs",
    "lock.rs",
    "nodes.rs",
    "parts/",
    "policy/mod.rs",
    "policy/watch.rs",
    "policy/whatif.rs",
    "probation.rs",
    "records.rs",
    "reservations.rs",
    "retention.rs",
    "spec_parse.rs",
    "view.rs",
    "workflow.rs",
    "yaml.rs",
];

/// The HTTP layer (`crate::X` paths a state module may not name): the
/// router and one module per resource under `http/`, and the rendering of
/// scrapes.
const HTTP: &[&str] = &["http", "metrics"];

/// The runtime that wires both together (may import anything): the server's
/// entry points and the HA leader loop.
const RUNTIME: &[&str] = &["lib.rs", "ha.rs"];

/// Crates of the HTTP stack a state module may not use.
const HTTP_CRATES: &[&str] = &["axum", "tower", "tower_http", "hyper", "reqwest"];

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("src dir") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The module path (`policy::whatif`) `super` means in the file at `rel`.
fn parent_module(rel: &str) -> Option<String> {
    let parts: Vec<&str> = rel.trim_end_matches(".rs").split('/').collect();
    // `a/b.rs` and `a/mod.rs` are children of `a` and of the crate root.
    match parts.as_slice() {
        [_, "mod"] => None,
        [dir, _] => Some((*dir).to_string()),
        _ => None,
    }
}

/// `source` without its comments.
fn code_of(source: &str) -> String {
    source
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The crate paths (`a::b`, from `crate::a::b`, `crate::{a, b::c}` or
/// `super::b` in module `a`) that `code` (of the file at `rel`) names,
/// and the crates of the HTTP stack it uses.
fn named_paths(rel: &str, code: &str) -> (Vec<String>, Vec<String>) {
    let mut crates = Vec::new();
    // Paths as written: `crate::a::b`, `crate::{a, b::c}`, `super::a`.
    let mut paths: Vec<String> = Vec::new();
    let bytes = code.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = code.is_char_boundary(i) && (i == 0 || !ident(bytes[i - 1]));
        if starts_word {
            let rest = &code[i..];
            let prefix = ["crate::", "super::"]
                .into_iter()
                .find(|p| rest.starts_with(p));
            if let Some(p) = prefix {
                let base = if p == "super::" {
                    parent_module(rel)
                } else {
                    None
                };
                let after = &rest[p.len()..];
                let body: Vec<String> = if let Some(group) = after.strip_prefix('{') {
                    let end = group.find('}').unwrap_or(group.len());
                    group[..end]
                        .split(',')
                        .map(|s| s.trim().replace(' ', ""))
                        .filter(|s| !s.is_empty())
                        .collect()
                } else {
                    let end = after
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                        .unwrap_or(after.len());
                    vec![after[..end].to_string()]
                };
                for b in body {
                    paths.push(match &base {
                        Some(m) => format!("{m}::{b}"),
                        None => b,
                    });
                }
            }
            for krate in HTTP_CRATES {
                if rest.starts_with(&format!("{krate}::")) && !crates.contains(&krate.to_string()) {
                    crates.push((*krate).to_string());
                }
            }
        }
        i += 1;
    }
    (paths, crates)
}

/// Whether `path` is module `module` or inside it.
fn is_in(path: &str, module: &str) -> bool {
    path == module || path.starts_with(&format!("{module}::"))
}

/// Every HTTP module or crate that `source` (the file at `rel`) names in
/// code (comments skipped).
fn http_imports(rel: &str, source: &str) -> Vec<String> {
    let (paths, mut found) = named_paths(rel, &code_of(source));
    for p in paths {
        for h in HTTP {
            if is_in(&p, h) && !found.contains(&h.to_string()) {
                found.push((*h).to_string());
            }
        }
    }
    found
}

/// The parts the control state coordinates: files (relative to `src/`)
/// whose code (their tests aside) must not name `crate::control`, so each
/// part can be read, tested and changed without `Control`.
const PARTS: &[&str] = &[
    "parts/",
    "records.rs",
    "reservations.rs",
    "workflow.rs",
    "blame.rs",
    "heartbeats.rs",
    "attempt.rs",
    "probation.rs",
];

fn is_part(rel: &str) -> bool {
    PARTS
        .iter()
        .any(|s| rel == *s || (s.ends_with('/') && rel.starts_with(s)))
}

/// Whether `source` (the file at `rel`) names the control module outside
/// its tests (from the first `#[cfg(test)]` on) and its comments.
fn names_control(rel: &str, source: &str) -> bool {
    let code = code_of(source);
    let code = code.split("#[cfg(test)]").next().unwrap_or("");
    named_paths(rel, code).0.iter().any(|p| is_in(p, "control"))
}

fn is_state(rel: &str) -> bool {
    STATE
        .iter()
        .any(|s| rel == *s || (s.ends_with('/') && rel.starts_with(s)))
}

fn is_http(rel: &str) -> bool {
    let module = rel
        .trim_end_matches(".rs")
        .trim_end_matches("/mod")
        .replace('/', "::");
    HTTP.iter()
        .any(|h| module == *h || module.starts_with(&format!("{h}::")))
}

#[test]
fn state_modules_import_no_http_module() {
    let root = src();
    let mut all = Vec::new();
    files(&root, &mut all);
    all.sort();
    let mut bad = Vec::new();
    let mut unclassified = Vec::new();
    for f in &all {
        let rel = f
            .strip_prefix(&root)
            .expect("under src")
            .to_string_lossy()
            .replace('\\', "/");
        if !is_state(&rel) && !is_http(&rel) && !RUNTIME.contains(&rel.as_str()) {
            unclassified.push(rel.clone());
        }
        if is_state(&rel) {
            let source = std::fs::read_to_string(f).expect("source");
            let hits = http_imports(&rel, &source);
            if !hits.is_empty() {
                bad.push(format!("src/{rel} imports {}", hits.join(", ")));
            }
        }
    }
    assert!(
        unclassified.is_empty(),
        "classify these modules as state, HTTP or runtime in tests/layers.rs: {unclassified:?}"
    );
    assert!(
        bad.is_empty(),
        "the state layer must not depend on HTTP modules:\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_listed_state_module_exists() {
    for s in STATE {
        let p = src().join(s);
        assert!(p.exists(), "tests/layers.rs lists {s}, which is gone");
    }
}

#[test]
fn the_scanner_sees_the_import_forms() {
    assert_eq!(
        http_imports("control.rs", "use crate::http::common::now;"),
        ["http"]
    );
    assert_eq!(
        http_imports("records.rs", "use crate::{records::X, metrics::Format};"),
        ["metrics"]
    );
    assert_eq!(
        http_imports("http/jobs.rs", "fn f() { super::common::now() }"),
        ["http"]
    );
    assert_eq!(
        http_imports("workflow.rs", "use axum::http::StatusCode;"),
        ["axum"]
    );
    assert_eq!(
        http_imports(
            "control.rs",
            "let x = crate::http_like::f(); // crate::http::common::now"
        ),
        Vec::<String>::new()
    );
    assert_eq!(
        http_imports("policy/mod.rs", "pub mod watch;\nuse crate::control::X;"),
        Vec::<String>::new()
    );
}

/// The `http/` modules that serve routes (a `#[utoipa::path]` or a router).
fn serves_routes(source: &str) -> bool {
    source.contains("#[utoipa::path") || source.contains("Router")
}

/// The file of the deepest module under `src/http/` that `segments` (a path
/// after `crate::http::`) names, if any.
fn http_module_file(segments: &[&str]) -> Option<PathBuf> {
    let dir = src().join("http");
    (1..=segments.len()).rev().find_map(|n| {
        let base = dir.join(segments[..n].join("/"));
        [base.with_extension("rs"), base.join("mod.rs")]
            .into_iter()
            .find(|f| f.exists())
    })
}

#[test]
fn http_common_imports_no_resource_module() {
    // Arrows point down: each resource and the router import `common`,
    // never the reverse, so a resource can be read and tested alone.
    let common = std::fs::read_to_string(src().join("http/common.rs")).expect("http/common.rs");
    let mut bad = Vec::new();
    for prefix in ["crate::http::", "super::"] {
        for (i, _) in common.match_indices(prefix) {
            let rest = &common[i + prefix.len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            let segments: Vec<&str> = rest[..end].split("::").filter(|s| !s.is_empty()).collect();
            let Some(file) = http_module_file(&segments) else {
                continue;
            };
            let source = std::fs::read_to_string(&file).expect("source");
            if !file.ends_with("common.rs") && serves_routes(&source) {
                bad.push(rest[..end].to_string());
            }
        }
    }
    assert!(
        bad.is_empty(),
        "http/common.rs imports resource modules: {bad:?}"
    );
}

#[test]
fn the_common_check_resolves_to_the_deepest_module() {
    let samples = http_module_file(&["dashboard", "samples", "QueueHistory"]).expect("samples");
    assert!(samples.ends_with("http/dashboard/samples.rs"));
    let jobs = http_module_file(&["jobs", "submit"]).expect("jobs");
    assert!(serves_routes(&std::fs::read_to_string(jobs).expect("jobs")));
}

#[test]
fn parts_of_the_control_state_do_not_name_control() {
    let root = src();
    let mut all = Vec::new();
    files(&root, &mut all);
    all.sort();
    let mut bad = Vec::new();
    let mut parts = 0;
    for f in &all {
        let rel = f
            .strip_prefix(&root)
            .expect("under src")
            .to_string_lossy()
            .replace('\\', "/");
        if !is_part(&rel) {
            continue;
        }
        parts += 1;
        let source = std::fs::read_to_string(f).expect("source");
        if names_control(&rel, &source) {
            bad.push(format!("src/{rel}"));
        }
    }
    // parts/mod.rs and six parts, plus the five older modules.
    assert!(parts >= 12, "only {parts} part modules found");
    assert!(
        bad.is_empty(),
        "a part of the control state names crate::control (it must know nothing of Control): {bad:?}"
    );
    for p in PARTS {
        assert!(
            src().join(p).exists(),
            "tests/layers.rs lists {p}, which is gone"
        );
    }
}

#[test]
fn the_control_check_sees_the_import_forms_and_skips_tests_and_comments() {
    assert!(names_control("parts/a.rs", "use crate::control::Control;"));
    assert!(names_control(
        "parts/a.rs",
        "use crate::{records::X, control};"
    ));
    assert!(names_control(
        "parts/a.rs",
        "fn f(c: &crate::control::Control<S>) {}"
    ));
    // `super` in a module under `control/` is the control module.
    assert!(names_control("control/a.rs", "use super::Control;"));
    assert!(!names_control("parts/a.rs", "use super::node_registry::X;"));
    assert!(!names_control(
        "parts/a.rs",
        "use crate::control_error::ControlError;"
    ));
    assert!(!names_control(
        "parts/a.rs",
        "/// See [`crate::control::Control`].\nfn f() {}"
    ));
    assert!(!names_control(
        "parts/a.rs",
        "fn f() {}\n#[cfg(test)]\nmod tests {\n    use crate::control::Control;\n}"
    ));
}
