//! A trace as the engine replays it: jobs in Gangway's terms and what
//! the loader did with the rows of its file. The loaders of the real traces
//! (and their decompression) are in `gangway-sim`; the what-if builds a
//! trace from a cluster's own history.

use gangway_core::{PriorityClass, Time};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use thiserror::Error;

/// One job of a trace, in Gangway's terms.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TraceJob {
    /// Row id in the source (for reports).
    pub name: String,
    /// Submission, seconds from the trace's first submission.
    pub submit: Time,
    /// Run time in seconds when it runs without interruption.
    pub duration: u64,
    /// Total GPUs of the gang (0 for CPU-only tasks).
    pub gpus: u32,
    /// CPU per job in thousandths of a core (0: not given).
    pub cpu_millis: u64,
    /// Memory per job in MiB (0: not given).
    pub memory_mib: u64,
    /// Queue (team / virtual cluster) it is charged to.
    pub queue: String,
    /// Priority class.
    pub priority: PriorityClass,
    /// Required GPU model, if the trace names one.
    pub gpu_model: Option<String>,
    /// Submitting user, if the trace names one (run-time prediction keys on it).
    pub user: String,
    /// The job's kind (model or application name), if the trace names one.
    pub app: Option<String>,
    /// The user's time limit (Slurm `--time`), seconds, if the trace has one.
    pub time_limit: Option<u64>,
}

/// What a loader did with the rows of its file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LoadReport {
    /// The file read.
    pub source: String,
    /// Data rows in the file.
    pub rows: usize,
    /// Jobs produced.
    pub loaded: usize,
    /// Rows skipped, by reason.
    pub skipped: BTreeMap<String, usize>,
    /// Rows kept but changed, by reason.
    pub adjusted: BTreeMap<String, usize>,
}

impl LoadReport {
    /// A report on `source`, with `rows` data rows, nothing loaded yet.
    pub fn of(source: &str, rows: usize) -> Self {
        LoadReport {
            source: source.to_string(),
            rows,
            ..Default::default()
        }
    }

    /// Counts a row skipped for `why`.
    pub fn skip(&mut self, why: &str) {
        *self.skipped.entry(why.to_string()).or_default() += 1;
    }
    /// Counts a row kept but changed for `why`.
    pub fn adjust(&mut self, why: &str) {
        *self.adjusted.entry(why.to_string()).or_default() += 1;
    }
    /// Rows skipped in all.
    pub fn skipped_total(&self) -> usize {
        self.skipped.values().sum()
    }
}

/// A loaded trace.
#[derive(Clone, Debug, Serialize)]
pub struct Trace {
    /// Trace name (`philly`, `chronus-mix1`, ...).
    pub name: String,
    /// Jobs by submission time.
    pub jobs: Vec<TraceJob>,
    /// What was skipped and why.
    pub report: LoadReport,
}

/// A trace file that could not be read at all.
#[derive(Debug, Error)]
pub enum TraceError {
    /// I/O.
    #[error("reading {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// Header missing a column.
    #[error("{path}: header lacks column {column:?} (found: {found})")]
    MissingColumn {
        /// File.
        path: String,
        /// Column.
        column: String,
        /// Header seen.
        found: String,
    },
    /// Unknown trace name.
    #[error("unknown trace {0:?}; known: {KNOWN}")]
    Unknown(String),
    /// The trace exists but has no job table here.
    #[error("trace {0:?} has no job table in this copy ({1})")]
    NoJobs(String, &'static str),
}

/// Names accepted by the simulator's `load`.
pub const KNOWN: &str =
    "philly, philly-excerpt, chronus-mix1, chronus-mix2, chronus-slo, tiresias-60, openb";

/// Reads a plain-text file of the traces folder (a cluster's node table).
pub fn read_plain(path: &Path) -> Result<String, TraceError> {
    std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })
}
