//! YAML with budgets: job specs and the server config are parsed by
//! serde-saphyr (maintained, panic-free) with limits on input size, nesting
//! depth, node count and alias expansion, so a small hostile document can
//! neither stall a parser thread nor make the server allocate gigabytes.

/// Largest YAML document accepted, in bytes.
pub const MAX_BYTES: usize = 4 << 20;
/// Deepest nesting of sequences and mappings (a job spec needs about 5).
pub const MAX_DEPTH: usize = 64;
/// Most parse events (nodes) in one document.
pub const MAX_NODES: usize = 250_000;
/// Most aliases (`*name`) in one document.
pub const MAX_ALIASES: usize = 100;
/// Most events alias expansion may replay in all.
pub const MAX_REPLAYED: usize = 10_000;

pub(crate) fn options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_reader_input_bytes = Some(MAX_BYTES);
    budget.max_depth = MAX_DEPTH;
    budget.max_events = MAX_NODES;
    budget.max_nodes = MAX_NODES;
    budget.max_aliases = MAX_ALIASES;
    budget.max_anchors = MAX_ALIASES;
    budget.max_documents = 1;
    budget.max_total_scalar_bytes = MAX_BYTES;
    let mut o = serde_saphyr::Options::default();
    o.budget = Some(budget);
    o.alias_limits.max_total_replayed_events = MAX_REPLAYED;
    o.alias_limits.max_replay_stack_depth = 8;
    o.alias_limits.max_alias_expansions_per_anchor = MAX_ALIASES;
    o
}

/// Parses one YAML document into `T` within the budgets above; the error
/// says what is wrong (and where) in one line.
pub fn from_str<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    if text.len() > MAX_BYTES {
        return Err(format!(
            "document of {} bytes; at most {MAX_BYTES}",
            text.len()
        ));
    }
    serde_saphyr::from_str_with_options(text, options()).map_err(|e| {
        let s = e.without_snippet().to_string();
        let mut msg = s.lines().next().unwrap_or("invalid YAML").to_string();
        // Name the field: quote the offending line (shortened).
        let line = e
            .location()
            .and_then(|l| usize::try_from(l.line()).ok())
            .and_then(|n| text.lines().nth(n.checked_sub(1)?))
            .map(str::trim)
            .filter(|l| !l.is_empty());
        if let Some(l) = line {
            let l: String = l.chars().take(80).collect();
            msg.push_str(&format!(" (in `{l}`)"));
        }
        msg
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn deep_nesting_is_refused_quickly() {
        let text = format!("{}{}", "[".repeat(70_000), "]".repeat(70_000));
        let t = Instant::now();
        let r: Result<serde_json::Value, _> = from_str(&text);
        assert!(r.is_err());
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[test]
    fn an_alias_bomb_is_refused() {
        let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..12 {
            let p = i - 1;
            text.push_str(&format!(
                "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
            ));
        }
        let r: Result<serde_json::Value, _> = from_str(&text);
        assert!(r.is_err(), "expanded a billion-node alias bomb");
    }

    #[test]
    fn an_ordinary_spec_parses() {
        let v: serde_json::Value =
            from_str("name: a\nqueue: q\nreplicas: 2\nrun:\n  command: [sh, -c, 'echo hi']\n")
                .expect("parses");
        assert_eq!(v["replicas"], 2);
    }
}
