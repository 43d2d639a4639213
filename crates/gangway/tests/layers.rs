//! Modules import one way, in every crate of the workspace. Every `crate::`
//! and `super::` path of every module (test modules left out) is resolved to
//! the deepest module file it names, and the strongly connected components of
//! that graph are the module cycles. A cycle fails this test, naming its
//! modules, unless it is in [`KNOWN_CYCLES`]; a listed cycle that no longer
//! exists fails it too, so the list only shrinks. The server's own rule (its
//! state layer imports no HTTP) is `crates/gangway-server/tests/layers.rs`.
//! `python3 /work/shared/tools/modcycles.py .` reads the tree the same way.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Cycles still present, each as its crate and its modules (sorted, `::`
/// paths, `lib` for the crate root). Remove an entry when its cycle is taken
/// apart; never add one.
const KNOWN_CYCLES: &[(&str, &[&str])] = &[];

type Module = Vec<String>;

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The crate's modules by path, each with its file; `src/bin/` is left out
/// (each file there is a crate of its own).
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut files = Vec::new();
    rs_files(src, &mut files);
    let mut mods = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(src).expect("under src").with_extension("");
        let mut parts: Module = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if parts.first().is_some_and(|p| p == "bin") {
            continue;
        }
        let last = parts.last().cloned().unwrap_or_default();
        if parts.len() == 1 && (last == "lib" || last == "main") {
            parts.clear();
        } else if last == "mod" {
            parts.pop();
        }
        mods.insert(parts, f);
    }
    mods
}

/// The module's code without its inline test module (from the first
/// `#[cfg(test)]` followed by `mod NAME {` on) and without `//` comments.
fn body(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut end = lines.len();
    for (i, l) in lines.iter().enumerate() {
        if l.trim() != "#[cfg(test)]" {
            continue;
        }
        let next = lines[i + 1..].iter().find(|l| !l.trim().is_empty());
        let is_mod = next.is_some_and(|n| {
            let n = n.trim();
            let n = n
                .strip_prefix("pub(crate) ")
                .or_else(|| n.strip_prefix("pub "))
                .unwrap_or(n);
            n.starts_with("mod ") && n.ends_with('{')
        });
        if is_mod {
            end = i;
            break;
        }
    }
    lines[..end]
        .iter()
        .map(|l| l.find("//").map_or(*l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// A tiny reader of paths: identifiers, `::`, `{`, `}`, `,` and `*`.
struct Reader<'a> {
    s: &'a [u8],
    i: usize,
}

impl Reader<'_> {
    fn skip_ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn eat(&mut self, tok: &str) -> bool {
        self.skip_ws();
        if self.s[self.i..].starts_with(tok.as_bytes()) {
            self.i += tok.len();
            true
        } else {
            false
        }
    }
    fn ident(&mut self) -> Option<String> {
        self.skip_ws();
        let start = self.i;
        while self.i < self.s.len() && is_ident(self.s[self.i] as char) {
            self.i += 1;
        }
        (self.i > start).then(|| String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }
    /// After a `::`: a segment, a `{ ... }` group or `*`; every full path
    /// found goes to `out`, each starting with `prefix`.
    fn tail(&mut self, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
        if self.eat("{") {
            loop {
                if self.eat("}") {
                    break;
                }
                match self.ident() {
                    Some(id) if id == "self" => out.push(prefix.clone()),
                    Some(id) => {
                        let mut p = prefix.clone();
                        p.push(id);
                        self.segments(p, out);
                    }
                    None if self.eat("*") => out.push(prefix.clone()),
                    None => {
                        // Anything else ends the group (a malformed or macro path).
                        out.push(prefix);
                        return;
                    }
                }
                if self.eat("as") {
                    let _ = self.ident();
                }
                if !self.eat(",") {
                    let _ = self.eat("}");
                    break;
                }
            }
        } else if let Some(id) = self.ident() {
            let mut p = prefix;
            p.push(id);
            self.segments(p, out);
        } else {
            out.push(prefix);
        }
    }
    fn segments(&mut self, path: Vec<String>, out: &mut Vec<Vec<String>>) {
        let save = self.i;
        if self.eat("::") {
            self.tail(path, out);
        } else {
            self.i = save;
            out.push(path);
        }
    }
}

/// Every `crate::…` and `super::…` path in `code`, groups expanded.
fn paths(code: &str) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let at_word = i == 0 || !is_ident(bytes[i - 1] as char);
        let head = ["crate", "super"]
            .into_iter()
            .find(|h| at_word && bytes[i..].starts_with(format!("{h}::").as_bytes()));
        match head {
            Some(h) => {
                let mut r = Reader {
                    s: bytes,
                    i: i + h.len(),
                };
                let mut found = Vec::new();
                r.segments(vec![h.to_string()], &mut found);
                out.extend(found);
                i = r.i.max(i + 1);
            }
            None => i += 1,
        }
    }
    out
}

/// The deepest module `base` + a prefix of `parts` names.
fn resolve(mods: &BTreeMap<Module, PathBuf>, base: &[String], parts: &[String]) -> Option<Module> {
    (0..=parts.len()).rev().find_map(|n| {
        let mut m = base.to_vec();
        m.extend_from_slice(&parts[..n]);
        mods.contains_key(&m).then_some(m)
    })
}

fn edges(mods: &BTreeMap<Module, PathBuf>) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut g = BTreeMap::new();
    for (m, f) in mods {
        let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let mut to = BTreeSet::new();
        for path in paths(&body(&text)) {
            let (mut base, mut rest): (Vec<String>, &[String]) = if path[0] == "crate" {
                (Vec::new(), &path[1..])
            } else {
                (m[..m.len().saturating_sub(1)].to_vec(), &path[1..])
            };
            while rest.first().is_some_and(|p| p == "super") {
                base.pop();
                rest = &rest[1..];
            }
            if let Some(r) = resolve(mods, &base, rest) {
                // The crate root re-exports and declares; it is no layer.
                if &r != m && !r.is_empty() {
                    to.insert(r);
                }
            }
        }
        g.insert(m.clone(), to);
    }
    g
}

/// Strongly connected components of more than one module (Tarjan).
fn cycles(g: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<BTreeSet<Module>> {
    struct T<'a> {
        g: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on: BTreeSet<&'a Module>,
        out: Vec<BTreeSet<Module>>,
    }
    fn go<'a>(t: &mut T<'a>, v: &'a Module) {
        let n = t.index.len();
        t.index.insert(v, n);
        t.low.insert(v, n);
        t.stack.push(v);
        t.on.insert(v);
        for w in &t.g[v] {
            if !t.index.contains_key(w) {
                go(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = BTreeSet::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.insert(w.clone());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v) {
            go(&mut t, v);
        }
    }
    t.out
}

fn name(m: &Module) -> String {
    if m.is_empty() {
        "lib".into()
    } else {
        m.join("::")
    }
}

/// Every crate's cycles, as (crate, sorted module names).
fn workspace_cycles() -> BTreeSet<(String, Vec<String>)> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates)
        .expect("crates dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("src").is_dir())
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 8,
        "found only {} crates under {}",
        dirs.len(),
        crates.display()
    );
    let mut found = BTreeSet::new();
    for d in dirs {
        let krate = d.file_name().expect("name").to_string_lossy().into_owned();
        let mods = modules(&d.join("src"));
        for c in cycles(&edges(&mods)) {
            let mut names: Vec<String> = c.iter().map(name).collect();
            names.sort();
            found.insert((krate.clone(), names));
        }
    }
    found
}

#[test]
fn no_module_cycle_beyond_the_known_ones() {
    let found = workspace_cycles();
    let known: BTreeSet<(String, Vec<String>)> = KNOWN_CYCLES
        .iter()
        .map(|(k, m)| (k.to_string(), m.iter().map(|s| s.to_string()).collect()))
        .collect();
    let mut problems = Vec::new();
    for (k, m) in found.difference(&known) {
        problems.push(format!(
            "{k}: module cycle of {} modules: {} (take it apart: modules import one way)",
            m.len(),
            m.join(", ")
        ));
    }
    for (k, m) in known.difference(&found) {
        problems.push(format!(
            "{k}: the known cycle {} no longer exists as listed: remove or shrink it in KNOWN_CYCLES",
            m.join(", ")
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The reader itself: groups, nested groups, `super::super`, comments and
/// test modules, on a small crate written here.
#[test]
fn the_reader_finds_cycles_through_groups_and_super() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("a")).expect("mkdir");
    let write = |p: &str, s: &str| std::fs::write(src.join(p), s).expect("write");
    write("lib.rs", "pub mod a;\npub mod b;\npub mod c;\npub mod d;\n");
    write("a/mod.rs", "pub mod inner;\n");
    // a::inner -> b through a nested group and super::super.
    write("a/inner.rs", "use super::super::{b::{self, X}, };\n");
    // b -> c; c -> a::inner through a group: a cycle a::inner -> b -> c -> a::inner.
    write("b.rs", "use crate::c::Y;\npub struct X;\n");
    write("c.rs", "use crate::{a::inner::Z, d};\npub struct Y;\n");
    // d names b only in a comment and a test module: no edge.
    write(
        "d.rs",
        "// crate::b::X\n#[cfg(test)]\nmod tests {\n    use crate::b::X;\n}\n",
    );
    let mods = modules(&src);
    let found: Vec<Vec<String>> = cycles(&edges(&mods))
        .iter()
        .map(|c| c.iter().map(name).collect())
        .collect();
    assert_eq!(found, vec![vec!["a::inner", "b", "c"]]);
    write("c.rs", "pub struct Y;\n");
    assert!(cycles(&edges(&modules(&src))).is_empty());
}
