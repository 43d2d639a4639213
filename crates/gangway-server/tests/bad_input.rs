//! Bad input never hurts the server: random and malformed bodies, huge
//! values and deep nesting sent to the API always get a 4xx naming the
//! problem, never a panic or a 5xx, and nothing is stored unless accepted.

mod common;

use gangway_core::NodeSpec;
use proptest::prelude::*;
use serde_json::{json, Value};

const CONFIG: &str = common::ONE_QUEUE;

use common::Server;

fn start() -> Server {
    let s = common::start(CONFIG);
    let node = NodeSpec::uniform("n0", "leaf0", "spine0", 8, "H100", 80);
    let (code, _) = s.send(
        "POST",
        "/v1/nodes",
        "agent-secret",
        "application/json",
        &serde_json::to_vec(&node).expect("json"),
    );
    assert_eq!(code, 201);
    s
}

impl Server {
    fn jobs(&self) -> usize {
        let (_, body) = self.send("GET", "/v1/jobs", "admin-secret", "application/json", b"");
        serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v.as_array().map(Vec::len))
            .unwrap_or(usize::MAX)
    }
}

/// JSON values shaped like job specs: the right field names with values of
/// any type and size, plus strangers.
fn spec_like() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,40}".prop_map(Value::String),
    ];
    let value = leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(
                prop::sample::select(vec![
                    "name",
                    "queue",
                    "replicas",
                    "gpus",
                    "resources",
                    "priority",
                    "run",
                    "command",
                    "image",
                    "mounts",
                    "env",
                    "checkpoint",
                    "signal",
                    "x",
                ])
                .prop_map(str::to_string),
                inner,
                0..5
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    prop::collection::btree_map(
        prop::sample::select(vec![
            "name",
            "queue",
            "user",
            "replicas",
            "min_replicas",
            "resources",
            "priority",
            "preemptible",
            "checkpoint",
            "restart",
            "runtime_seconds",
            "topology",
            "run",
            "bogus",
        ])
        .prop_map(str::to_string),
        value,
        0..8,
    )
    .prop_map(|m| Value::Object(m.into_iter().collect()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_bodies_get_a_4xx_and_change_nothing(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
        spec in spec_like(),
        yaml in any::<bool>(),
    ) {
        SERVER.with(|s| -> Result<(), TestCaseError> {
            let before = s.jobs();
            let mut accepted = 0;
            let ct = if yaml { "application/yaml" } else { "application/json" };
            for body in [bytes.clone(), serde_json::to_vec(&spec).expect("json")] {
                for (path, token) in [("/v1/jobs", "admin-secret"), ("/v1/jobs", "alice-token"), ("/v1/nodes", "agent-secret"), ("/v1/agent/n0/report", "admin-secret"), ("/v1/agent/n0/sync", "admin-secret")] {
                    let (code, answer) = s.send("POST", path, token, ct, &body);
                    prop_assert!(code < 500, "{path} answered {code}: {answer}");
                    if (200..300).contains(&code) {
                        accepted += usize::from(path == "/v1/jobs");
                    } else {
                        prop_assert!(answer.contains("\"error\""), "{path} {code}: an error names the problem: {answer}");
                    }
                }
            }
            prop_assert_eq!(s.jobs(), before + accepted, "only accepted jobs are stored");
            Ok(())
        })?;
    }
}

thread_local! {
    static SERVER: Server = start();
}

#[test]
fn huge_values_and_deep_nesting_are_refused_cleanly() {
    let s = start();
    let deep_json = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let deep_yaml = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    let huge = json!({
        "name": "x".repeat(1 << 20), "queue": "research", "replicas": u64::MAX,
        "resources": { "gpus": 4_294_967_296u64 }
    })
    .to_string();
    let huge_ok_types =
        r#"{"name":"a","queue":"research","replicas":4000000000,"resources":{"gpus":4000000000}}"#;
    let cases: Vec<(&str, String)> = vec![
        ("application/json", deep_json),
        ("application/yaml", deep_yaml),
        ("application/json", huge),
        ("application/json", huge_ok_types.to_string()),
        ("application/yaml", "a: &a [*a, *a, *a]".to_string()),
        ("application/yaml", "name: [".to_string()),
        ("application/json", "\u{0}\u{1}".to_string()),
    ];
    for (ct, body) in cases {
        let (code, answer) = s.send("POST", "/v1/jobs", "admin-secret", ct, body.as_bytes());
        assert!(
            (400..500).contains(&code),
            "{code}: {}",
            &answer[..answer.len().min(200)]
        );
        assert!(answer.contains("\"error\""), "{answer}");
    }
    // Bogus paths and methods too.
    for (m, p) in [
        ("GET", "/v1/jobs/not-a-number"),
        ("POST", "/v1/jobs/1/explode"),
        ("DELETE", "/v1/jobs"),
        ("GET", "/v1/jobs?limit=-1"),
    ] {
        let (code, _) = s.send(m, p, "admin-secret", "application/json", b"");
        assert!((400..500).contains(&code), "{m} {p}: {code}");
    }
    assert_eq!(s.jobs(), 0, "nothing was stored");
}

/// Hostile YAML shapes: deep nesting, alias fan-out, huge scalars, broken
/// syntax, each of a random size.
fn hostile_yaml() -> impl Strategy<Value = String> {
    prop_oneof![
        (1usize..80_000).prop_map(|d| format!("{}1{}", "[".repeat(d), "]".repeat(d))),
        (1usize..40_000).prop_map(|d| "- ".repeat(d) + "x"),
        (1usize..20_000).prop_map(|d| {
            (0..d)
                .map(|i| format!("{}k: ", " ".repeat(i % 64)))
                .collect::<String>()
        }),
        (2usize..12, 2usize..12).prop_map(|(levels, fan)| {
            let mut t = String::from("a0: &a0 [x]\n");
            for i in 1..levels {
                let refs = vec![format!("*a{}", i - 1); fan].join(", ");
                t.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
            }
            t
        }),
        // Up to just under max_body_bytes (1 MiB): larger bodies are refused unread (tested in security.rs).
        (1usize..1_000_000).prop_map(|n| format!("name: {}\nqueue: research\n", "x".repeat(n))),
        ".{0,200}".prop_map(|s| format!("name: {s}\nqueue: [{s}\n")),
        Just("name: !!binary AAAA\nqueue: research\nreplicas: 1\n".to_string()),
        Just("--- a\n--- b\n--- c\n".to_string()),
        Just("<<: *nothing\n".to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn hostile_yaml_is_refused_quickly_and_changes_nothing(yaml in hostile_yaml()) {
        SERVER.with(|s| -> Result<(), TestCaseError> {
            let before = s.jobs();
            let t = std::time::Instant::now();
            let (code, answer) = s.send("POST", "/v1/jobs", "admin-secret", "application/yaml", yaml.as_bytes());
            prop_assert!((400..500).contains(&code), "{code}: {}", &answer[..answer.len().min(200)]);
            prop_assert!(answer.contains("\"error\""));
            prop_assert!(t.elapsed() < std::time::Duration::from_secs(3), "took {:?}", t.elapsed());
            prop_assert_eq!(s.jobs(), before);
            // The parser itself, straight: an error, never a panic.
            prop_assert!(gangway_server::yaml::from_str::<gangway_core::JobSpec>(&yaml).is_err());
            Ok(())
        })?;
    }
}
