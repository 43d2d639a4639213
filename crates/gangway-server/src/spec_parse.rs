//! Job specs parsed with errors in the user's terms: the field path
//! (`resources.gpus`), what was expected in plain words, the line and column
//! in the document the user wrote, and "did you mean" for unknown fields.
//! The CLI runs this on the user's YAML before sending it, so positions are
//! the file's; the server runs it on what it receives (JSON or YAML).

use gangway_core::JobSpec;
use std::fmt;

/// Why a job spec did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct SpecParseError {
    /// Dotted field path (`resources.gpus`, `run.command[0]`); empty for the
    /// document itself.
    pub path: String,
    /// What is wrong, in plain words.
    pub message: String,
    /// 1-based line and column in the document, when known.
    pub position: Option<(u64, u64)>,
}

impl SpecParseError {
    /// The error with its position written as `FILE:LINE:COLUMN`.
    pub fn in_file(&self, file: &str) -> String {
        let mut s = self.head();
        match self.position {
            Some((l, c)) => s.push_str(&format!(" at {file}:{l}:{c}")),
            None => s.push_str(&format!(" in {file}")),
        }
        s
    }

    fn head(&self) -> String {
        if self.path.is_empty() {
            self.message.clone()
        } else {
            format!("{}: {}", self.path, self.message)
        }
    }
}

impl fmt::Display for SpecParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.head())?;
        if let Some((l, c)) = self.position {
            write!(f, " at line {l}, column {c}")?;
        }
        Ok(())
    }
}

/// Parses a YAML job spec (within [`crate::yaml`]'s budgets).
pub fn job_spec_from_yaml(text: &str) -> Result<JobSpec, SpecParseError> {
    if text.len() > crate::yaml::MAX_BYTES {
        return Err(SpecParseError {
            path: String::new(),
            message: format!(
                "document of {} bytes; at most {}",
                text.len(),
                crate::yaml::MAX_BYTES
            ),
            position: None,
        });
    }
    let mut path = None;
    serde_saphyr::with_deserializer_from_str_with_options(text, crate::yaml::options(), |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            path = Some(e.path().to_string());
            e.into_inner()
        })
    })
    .map_err(|e| {
        let e = e.without_snippet();
        let path = path.as_deref().unwrap_or("");
        let position = e.location().map(|l| (l.line(), l.column()));
        let scalar = || {
            position
                .and_then(|(l, c)| scalar_at(text, l, c))
                .unwrap_or_default()
        };
        match e {
            serde_saphyr::Error::SerdeUnknownField {
                field, expected, ..
            } => {
                let allowed: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
                let mut e = explain(path, &format!("unknown field `{field}`"), position);
                e.message = unknown_field(field, &allowed);
                e
            }
            serde_saphyr::Error::SerdeUnknownVariant {
                variant, expected, ..
            } => {
                let allowed: Vec<String> = expected.iter().map(|s| format!("`{s}`")).collect();
                explain(
                    path,
                    &format!(
                        "unknown variant `{variant}`, expected one of {}",
                        allowed.join(", ")
                    ),
                    position,
                )
            }
            serde_saphyr::Error::InvalidScalar { ty, .. } => SpecParseError {
                path: path.to_string(),
                message: got_instead(path, ty, &serde_style(&scalar())),
                position,
            },
            serde_saphyr::Error::Unexpected { expected, .. } => {
                let exp = match *expected {
                    "sequence start" => "a sequence",
                    "mapping start" => "a map",
                    other => other,
                };
                SpecParseError {
                    path: path.to_string(),
                    message: got_instead(path, exp, &serde_style(&scalar())),
                    position,
                }
            }
            other => {
                let raw = other.to_string();
                let raw = raw.lines().next().unwrap_or("invalid YAML");
                // The message may carry the position again; it is reported apart.
                let raw = raw.split(" at line ").next().unwrap_or(raw);
                explain(path, raw, position)
            }
        }
    })
}

/// The plain scalar that starts at 1-based `line`, `column` of `text`, with a
/// trailing comment cut off; empty when the position is past the line.
fn scalar_at(text: &str, line: u64, column: u64) -> Option<String> {
    let l = text
        .lines()
        .nth(usize::try_from(line).ok()?.checked_sub(1)?)?;
    let start = usize::try_from(column).ok()?.checked_sub(1)?;
    let rest: String = l.chars().skip(start).collect();
    let rest = match rest.find(" #") {
        Some(i) => &rest[..i],
        None => &rest,
    };
    Some(rest.trim().chars().take(80).collect())
}

/// A YAML scalar described as serde describes an unexpected value
/// (`integer -60`, `string "2"`), for [`got_instead`].
fn serde_style(scalar: &str) -> String {
    if scalar.is_empty() {
        "nothing".into()
    } else if scalar.parse::<i128>().is_ok() {
        format!("integer {scalar}")
    } else if scalar.parse::<f64>().is_ok() {
        format!("floating point `{scalar}`")
    } else if scalar.starts_with(['[', '{']) {
        scalar.to_string()
    } else {
        let unquoted = scalar
            .strip_prefix('"')
            .and_then(|s| s.strip_suffix('"'))
            .or_else(|| scalar.strip_prefix('\'').and_then(|s| s.strip_suffix('\'')))
            .unwrap_or(scalar);
        format!("string {unquoted:?}")
    }
}

/// Parses a JSON job spec.
pub fn job_spec_from_json(body: &[u8]) -> Result<JobSpec, SpecParseError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let spec: JobSpec = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let position = (inner.line() > 0).then(|| (inner.line() as u64, inner.column() as u64));
        let raw = inner.to_string();
        let raw = match raw.rsplit_once(" at line ") {
            Some((head, _)) if position.is_some() => head.to_string(),
            _ => raw,
        };
        explain(&path, &raw, position)
    })?;
    de.end().map_err(|e| SpecParseError {
        path: String::new(),
        message: "trailing characters after the job spec".into(),
        position: Some((e.line() as u64, e.column() as u64)),
    })?;
    Ok(spec)
}

/// Turns a deserializer's message at `path` into plain words.
fn explain(path: &str, raw: &str, position: Option<(u64, u64)>) -> SpecParseError {
    // serde_path_to_error writes `.` for the root.
    let path = if path == "." { "" } else { path };
    let mut path = path.to_string();
    let message = if let Some(rest) = raw.strip_prefix("unknown field `") {
        let (field, allowed) = rest.split_once('`').unwrap_or((rest, ""));
        // The path already ends in the unknown field; report it at its parent.
        if let Some(parent) = path.strip_suffix(field) {
            path = parent.trim_end_matches('.').to_string();
        }
        unknown_field(field, &backticked(allowed))
    } else if let Some(rest) = raw.strip_prefix("missing field `") {
        let field = rest.split('`').next().unwrap_or(rest);
        path = if path.is_empty() {
            field.to_string()
        } else {
            format!("{path}.{field}")
        };
        format!("missing; it is required ({})", expected(&path, ""))
    } else if let Some(rest) = raw
        .strip_prefix("invalid type: ")
        .or_else(|| raw.strip_prefix("invalid value: "))
    {
        let (got, exp) = rest.rsplit_once(", expected ").unwrap_or((rest, ""));
        got_instead(&path, exp, got)
    } else if let Some(rest) = raw.strip_prefix("unknown variant `") {
        let (got, allowed) = rest.split_once('`').unwrap_or((rest, ""));
        let allowed = backticked(allowed);
        let mut m = format!(
            "unknown value `{}`; one of: {}",
            short(got),
            allowed.join(", ")
        );
        if let Some(near) = nearest(got, &allowed) {
            m.push_str(&format!(" (did you mean `{near}`?)"));
        }
        m
    } else {
        raw.to_string()
    };
    SpecParseError {
        path,
        message,
        position,
    }
}

/// The names between backticks in `s`.
fn backticked(s: &str) -> Vec<String> {
    s.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

fn unknown_field(field: &str, allowed: &[String]) -> String {
    let field = &short(field);
    match nearest(field, allowed) {
        Some(near) => format!("unknown field `{field}`; did you mean `{near}`?"),
        None if allowed.is_empty() => format!("unknown field `{field}`"),
        None => format!(
            "unknown field `{field}`; the fields here are: {}",
            allowed.join(", ")
        ),
    }
}

/// The allowed name closest to `word`, when it is close enough to be a typo.
fn nearest<'a>(word: &str, allowed: &'a [String]) -> Option<&'a str> {
    let w = word.to_ascii_lowercase();
    let len = w.chars().count();
    let limit = |a: &str| (a.chars().count() / 3).max(1);
    allowed
        .iter()
        // The distance is at least the difference in length: a long word is
        // never measured (a huge key costs nothing).
        .filter(|a| len.abs_diff(a.chars().count()) <= limit(a))
        .map(|a| (edit_distance(&w, a), a))
        .filter(|(d, a)| *d <= limit(a))
        .min_by_key(|(d, _)| *d)
        .map(|(_, a)| a.as_str())
}

/// Edit distance over characters, a swap of two neighbours counting as one
/// edit (optimal string alignment), as typos are often swaps.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // d[i][j]: distance between a[..i] and b[..j].
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

/// At most 80 characters of `s` (what a message may quote of the input).
fn short(s: &str) -> String {
    if s.chars().count() <= 80 {
        return s.to_string();
    }
    let mut t: String = s.chars().take(79).collect();
    t.push('…');
    t
}

/// "expected X (got Y)", with advice for a command written as one string.
fn got_instead(path: &str, exp: &str, got: &str) -> String {
    let got = &short(got);
    let got_plain = match got.split_once(' ') {
        Some(("string", s)) => format!("the string {s}"),
        Some(("integer" | "floating", _)) | Some(("boolean", _)) => got
            .rsplit(' ')
            .next()
            .unwrap_or(got)
            .trim_matches('`')
            .to_string(),
        None if got == "map" => "a mapping".into(),
        None if got == "sequence" => "a list".into(),
        _ => got.to_string(),
    };
    let mut m = format!("{} (got {got_plain})", expected(path, exp));
    if path == "run.command" {
        if let Some(("string", s)) = got.split_once(' ') {
            m.push_str(&format!(
                "; the command is not run by a shell: write its words as a list, or \
                 [\"sh\", \"-c\", {s}] to run it through sh"
            ));
        }
    }
    m
}

/// What a field takes, in plain words.
fn expected(path: &str, exp: &str) -> String {
    let field = match path {
        "replicas" => Some("a whole number of replicas, e.g. 2"),
        "min_replicas" => Some("a whole number of replicas, e.g. 1"),
        "resources.gpus" => Some("a whole number of GPUs, e.g. 2"),
        "resources.cpu_millis" => Some("a whole number of milli-CPUs, e.g. 8000 for 8 cores"),
        "resources.memory_mib" => Some("a whole number of MiB, e.g. 65536 for 64 GiB"),
        "resources.min_gpu_memory_gib" => Some("a whole number of GiB, e.g. 80"),
        "runtime_seconds" => Some("a whole number of seconds, 0 or more, e.g. 3600"),
        "run.command" => Some("a list of words, e.g. [\"python\", \"train.py\"]"),
        "queue" => Some("a queue name"),
        "name" => Some("a job name"),
        _ => None,
    };
    if let Some(f) = field {
        return format!("expected {f}");
    }
    let plain = match exp {
        "u8" | "u16" | "u32" | "u64" | "usize" => "a whole number, 0 or more",
        "i8" | "i16" | "i32" | "i64" => "a whole number",
        "a boolean" => "true or false",
        "a sequence" => "a list",
        "a string" => "a string",
        "" => "a value",
        e if e.starts_with("struct ") || e == "a map" => "a mapping of fields",
        e => e,
    };
    format!("expected {plain}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "name: t\nqueue: q\nreplicas: 1\nresources:\n  gpus: 1\n";

    fn yaml_err(text: &str) -> SpecParseError {
        match job_spec_from_yaml(text) {
            Ok(_) => panic!("parsed: {text}"),
            Err(e) => e,
        }
    }

    #[test]
    fn gpus_as_a_word_names_the_field_and_the_line() {
        let e = yaml_err("name: t\nqueue: q\nreplicas: 1\nresources:\n  gpus: two\n");
        assert_eq!(e.path, "resources.gpus");
        assert_eq!(
            e.message,
            "expected a whole number of GPUs, e.g. 2 (got the string \"two\")"
        );
        assert_eq!(e.position, Some((5, 9)), "{e}");
        // YAML reads a quoted number into a number field as the number.
        let spec =
            job_spec_from_yaml("name: t\nqueue: q\nreplicas: 1\nresources:\n  gpus: \"2\"\n")
                .unwrap();
        assert_eq!(spec.resources.gpus, 2);
    }

    #[test]
    fn negative_runtime() {
        let e = yaml_err(&format!("{BASE}runtime_seconds: -60\n"));
        assert_eq!(e.path, "runtime_seconds");
        assert!(e.message.contains("whole number of seconds"), "{e}");
        assert!(e.message.contains("-60"), "{e}");
        assert_eq!(e.position.map(|p| p.0), Some(6), "{e}");
    }

    #[test]
    fn command_as_a_string_gets_the_sh_advice() {
        let e = yaml_err(&format!("{BASE}run:\n  command: python train.py\n"));
        assert_eq!(e.path, "run.command");
        assert!(
            e.message.contains("[\"sh\", \"-c\", \"python train.py\"]"),
            "{e}"
        );
        assert_eq!(e.position.map(|p| p.0), Some(7), "{e}");
    }

    #[test]
    fn unknown_field_says_did_you_mean() {
        let e = yaml_err("name: t\nqueue: q\nreplica: 2\nresources:\n  gpus: 1\n");
        assert_eq!(e.path, "");
        assert_eq!(
            e.message,
            "unknown field `replica`; did you mean `replicas`?"
        );
        assert_eq!(e.position.map(|p| p.0), Some(3), "{e}");
        let e = yaml_err("name: t\nqueue: q\nreplicas: 1\nresources:\n  gpu: 1\n");
        assert_eq!(e.path, "resources");
        assert!(e.message.contains("did you mean `gpus`?"), "{e}");
        let e = yaml_err(&format!("{BASE}zzzzzz: 1\n"));
        assert!(e.message.contains("the fields here are: name,"), "{e}");
    }

    #[test]
    fn json_errors_have_paths_and_plain_words() {
        let e = job_spec_from_json(
            br#"{"name":"t","queue":"q","replicas":1,"resources":{"gpus":"2"}}"#,
        )
        .unwrap_err();
        assert_eq!(e.path, "resources.gpus");
        assert!(
            e.message.starts_with("expected a whole number of GPUs"),
            "{e}"
        );
        assert!(e.position.is_some());
        let e = job_spec_from_json(br#"{"name":"t","queue":"q","replica":1}"#).unwrap_err();
        assert!(e.message.contains("did you mean `replicas`?"), "{e}");
    }

    #[test]
    fn queue_may_be_left_out() {
        let spec = job_spec_from_yaml("name: t\nreplicas: 1\nresources:\n  gpus: 1\n").unwrap();
        assert_eq!(spec.queue, "");
    }

    #[test]
    fn a_missing_field_and_an_unknown_value() {
        let e = yaml_err("name: t\nqueue: q\nresources:\n  gpus: 1\n");
        assert_eq!(e.path, "replicas");
        assert_eq!(
            e.message,
            "missing; it is required (expected a whole number of replicas, e.g. 2)"
        );
        let e = yaml_err(&format!("{BASE}priority: hgih\n"));
        assert_eq!(e.path, "priority");
        assert!(
            e.message.starts_with("unknown value `hgih`; one of: "),
            "{e}"
        );
        assert!(e.message.ends_with("(did you mean `high`?)"), "{e}");
    }

    #[test]
    fn a_huge_value_is_not_echoed_back() {
        let big = "x".repeat(100_000);
        let body = format!(
            r#"{{"name":"t","queue":"q","replicas":1,"resources":{{"gpus":"{big}"}},"{big}":1}}"#
        );
        let e = job_spec_from_json(body.as_bytes()).unwrap_err();
        assert!(e.to_string().len() < 300, "{}", e.to_string().len());
        let body = format!(r#"{{"name":"t","queue":"q","{big}":1}}"#);
        let e = job_spec_from_json(body.as_bytes()).unwrap_err();
        assert!(e.to_string().len() < 600, "{}", e.to_string().len());
    }

    #[test]
    fn the_example_job_files_parse() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples");
        for name in ["job.yaml", "train.yaml", "ddp.yaml", "ddp_torchrun.yaml"] {
            let text = std::fs::read_to_string(format!("{dir}/{name}")).expect("example");
            if let Err(e) = job_spec_from_yaml(&text) {
                panic!("{}", e.in_file(name));
            }
        }
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("replica", "replicas"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("hgih", "high"), 1);
    }
}
