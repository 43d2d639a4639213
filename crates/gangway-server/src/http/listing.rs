//! Pages of the job list (`GET /v1/jobs`): filters (`state=a,b`, `active`,
//! `queue`, `user`), a bounded page size and an opaque cursor, so a listing
//! never answers with every job ever submitted.
//!
//! The body stays a JSON array of jobs (what every client already reads);
//! the cursor of the next page, when there is one, comes in the
//! `X-Next-Cursor` header and in a `Link: <...>; rel="next"` header.

use gangway_core::{JobId, JobState};
use serde::Deserialize;

/// Jobs in a page when the request does not say.
pub const DEFAULT_PAGE: usize = 500;
/// The largest page a request may ask for.
pub const MAX_PAGE: usize = 5_000;
/// Longest accepted filter value (queue, user, state list, cursor).
const MAX_PARAM: usize = 1024;

/// The query of `GET /v1/jobs`, as sent.
#[derive(Deserialize, Default, Debug, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct JobQuery {
    /// Only this queue.
    pub queue: Option<String>,
    /// Only these states, comma-separated (`pending,running`).
    pub state: Option<String>,
    /// Only this user's jobs.
    pub user: Option<String>,
    /// Only jobs that have not ended (`true`) or only ended ones (`false`).
    pub active: Option<bool>,
    /// The cursor of the previous page's answer.
    pub cursor: Option<String>,
    /// Skip this many matching jobs (after the cursor).
    pub offset: Option<usize>,
    /// At most this many jobs (default 500, at most 5,000).
    pub limit: Option<usize>,
    /// Newest first.
    #[serde(default)]
    pub desc: bool,
}

/// A refused job query: names the parameter.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{field}: {problem}")]
pub struct QueryError {
    /// The parameter.
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

fn bad(field: &'static str, problem: impl Into<String>) -> QueryError {
    QueryError {
        field,
        problem: problem.into(),
    }
}

/// A checked job query: what [`JobQuery`] asks, ready to filter with.
#[derive(Debug, PartialEq, Eq)]
pub struct JobPage {
    /// Only this queue.
    pub queue: Option<String>,
    /// Only these states (empty: any).
    pub states: Vec<JobState>,
    /// Only this user.
    pub user: Option<String>,
    /// Active (true) or ended (false) jobs only.
    pub active: Option<bool>,
    /// Start after this job (exclusive), in the page's direction.
    pub after: Option<JobId>,
    /// Matching jobs to skip.
    pub offset: usize,
    /// Page size.
    pub limit: usize,
    /// Newest first.
    pub desc: bool,
}

/// The cursor that continues after `last` in the given direction.
pub fn cursor_after(last: JobId, desc: bool) -> String {
    format!("{}{:x}", if desc { 'd' } else { 'a' }, last.0)
}

fn parse_cursor(c: &str, desc: bool) -> Result<JobId, QueryError> {
    let not_ours = || bad("cursor", "not a cursor this server issued");
    let (dir, hex) = c.split_at_checked(1).ok_or_else(not_ours)?;
    let id = u64::from_str_radix(hex, 16).map_err(|_| not_ours())?;
    match (dir, desc) {
        ("a", false) | ("d", true) => Ok(JobId(id)),
        ("a", true) | ("d", false) => Err(bad(
            "cursor",
            "issued for the other order (keep desc as it was for the first page)",
        )),
        _ => Err(not_ours()),
    }
}

/// The `Link` header of the next page: the same query with the new cursor.
pub fn next_link(raw_query: &str, cursor: &str) -> String {
    let mut parts: Vec<&str> = raw_query
        .split('&')
        .filter(|kv| !kv.is_empty() && !kv.starts_with("cursor="))
        .collect();
    let c = format!("cursor={cursor}");
    parts.push(&c);
    format!("</v1/jobs?{}>; rel=\"next\"", parts.join("&"))
}

/// Parses one state name as the API spells it (`pending`, `running`...).
pub fn parse_state(s: &str) -> Option<JobState> {
    serde_json::from_value(serde_json::Value::String(s.trim().to_string())).ok()
}

impl JobQuery {
    /// Checks every parameter (ranges, lengths, state names, cursor).
    pub fn check(self) -> Result<JobPage, QueryError> {
        for (field, v) in [
            ("queue", &self.queue),
            ("state", &self.state),
            ("user", &self.user),
            ("cursor", &self.cursor),
        ] {
            if v.as_ref().is_some_and(|v| v.len() > MAX_PARAM) {
                return Err(bad(field, format!("at most {MAX_PARAM} bytes")));
            }
        }
        let limit = self.limit.unwrap_or(DEFAULT_PAGE);
        if limit == 0 || limit > MAX_PAGE {
            return Err(bad(
                "limit",
                format!("must be 1 to {MAX_PAGE}, got {limit}"),
            ));
        }
        let mut states = Vec::new();
        for name in self.state.iter().flat_map(|s| s.split(',')) {
            if name.trim().is_empty() {
                continue;
            }
            let st = parse_state(name).ok_or_else(|| {
                bad(
                    "state",
                    format!(
                        "unknown state {:?} (pending, scheduled, running, preempting, requeued, restarting, succeeded, failed, cancelled, timeout)",
                        name.chars().take(64).collect::<String>()
                    ),
                )
            })?;
            if !states.contains(&st) {
                states.push(st);
            }
        }
        let after = match &self.cursor {
            Some(c) => Some(parse_cursor(c, self.desc)?),
            None => None,
        };
        Ok(JobPage {
            queue: self.queue,
            states,
            user: self.user,
            active: self.active,
            after,
            offset: self.offset.unwrap_or(0),
            limit,
            desc: self.desc,
        })
    }
}

/// What a job needs to be filtered: its id, state, queue and owner.
pub trait Listed {
    /// Its id.
    fn id(&self) -> JobId;
    /// Its lifecycle state.
    fn state(&self) -> JobState;
    /// Its queue.
    fn queue(&self) -> &str;
    /// Its owner.
    fn user(&self) -> &str;
}

impl Listed for crate::records::JobRecord {
    fn id(&self) -> JobId {
        self.id
    }
    fn state(&self) -> JobState {
        self.state
    }
    fn queue(&self) -> &str {
        &self.spec.queue
    }
    fn user(&self) -> &str {
        &self.user
    }
}

impl<T: Listed> Listed for std::sync::Arc<T> {
    fn id(&self) -> JobId {
        (**self).id()
    }
    fn state(&self) -> JobState {
        (**self).state()
    }
    fn queue(&self) -> &str {
        (**self).queue()
    }
    fn user(&self) -> &str {
        (**self).user()
    }
}

impl JobPage {
    /// Whether a job passes the filters (not the cursor).
    pub fn matches<J: Listed>(&self, j: &J) -> bool {
        self.queue.as_deref().is_none_or(|q| j.queue() == q)
            && self.user.as_deref().is_none_or(|u| j.user() == u)
            && (self.states.is_empty() || self.states.contains(&j.state()))
            && self.active.is_none_or(|a| a != j.state().is_terminal())
    }

    /// One page of `jobs` (in id order) and the cursor of the next page, if
    /// any job may follow. Walks only from the cursor on.
    pub fn select<'a, J: Listed + Clone + 'a>(
        &self,
        jobs: &'a imbl::OrdMap<JobId, (J, u64)>,
    ) -> (Vec<&'a J>, Option<String>) {
        use std::ops::Bound::{Excluded, Unbounded};
        let it: Box<dyn Iterator<Item = &'a (J, u64)>> = match (self.after, self.desc) {
            (Some(a), false) => Box::new(jobs.range((Excluded(a), Unbounded)).map(|(_, v)| v)),
            (Some(a), true) => Box::new(jobs.range((Unbounded, Excluded(a))).rev().map(|(_, v)| v)),
            (None, false) => Box::new(jobs.values()),
            (None, true) => Box::new(jobs.values().rev()),
        };
        let mut out = Vec::new();
        let mut more = false;
        for j in it
            .map(|(j, _)| j)
            .filter(|j| self.matches(*j))
            .skip(self.offset)
        {
            if out.len() == self.limit {
                more = true;
                break;
            }
            out.push(j);
        }
        let next = more
            .then(|| out.last().map(|j| cursor_after(j.id(), self.desc)))
            .flatten();
        (out, next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
    struct J(u64, JobState, &'static str);
    impl Listed for J {
        fn id(&self) -> JobId {
            JobId(self.0)
        }
        fn state(&self) -> JobState {
            self.1
        }
        fn queue(&self) -> &str {
            "q"
        }
        fn user(&self) -> &str {
            self.2
        }
    }

    fn jobs(n: u64) -> imbl::OrdMap<JobId, (J, u64)> {
        (1..=n)
            .map(|i| {
                let st = if i % 2 == 0 {
                    JobState::Succeeded
                } else {
                    JobState::Pending
                };
                (
                    JobId(i),
                    (J(i, st, if i % 3 == 0 { "bob" } else { "al" }), 0),
                )
            })
            .collect()
    }

    fn q(s: &str) -> Result<JobPage, QueryError> {
        let mut out = JobQuery::default();
        for kv in s.split('&').filter(|x| !x.is_empty()) {
            let (k, v) = kv.split_once('=').expect("k=v");
            match k {
                "state" => out.state = Some(v.into()),
                "cursor" => out.cursor = Some(v.into()),
                "limit" => out.limit = Some(v.parse().expect("n")),
                "desc" => out.desc = v == "true",
                "active" => out.active = Some(v == "true"),
                "user" => out.user = Some(v.into()),
                _ => panic!("{k}"),
            }
        }
        out.check()
    }

    #[test]
    fn pages_walk_every_match_once_in_both_orders() {
        let all = jobs(23);
        for desc in [false, true] {
            let mut seen = Vec::new();
            let mut cursor: Option<String> = None;
            loop {
                let mut s = format!("limit=4&desc={desc}&active=true");
                if let Some(c) = &cursor {
                    s += &format!("&cursor={c}");
                }
                let (page, next) = q(&s).expect("query").select(&all);
                assert!(page.len() <= 4);
                seen.extend(page.iter().map(|j| j.0));
                match next {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
            let mut want: Vec<u64> = (1..=23).filter(|i| i % 2 == 1).collect();
            if desc {
                want.reverse();
            }
            assert_eq!(seen, want, "desc={desc}");
        }
    }

    #[test]
    fn the_next_link_keeps_the_filters_and_replaces_the_cursor() {
        assert_eq!(
            next_link("state=pending&cursor=a1&limit=2", "a9"),
            "</v1/jobs?state=pending&limit=2&cursor=a9>; rel=\"next\""
        );
    }

    #[test]
    fn a_full_last_page_has_no_next_cursor() {
        let all = jobs(4);
        let (page, next) = q("limit=4").expect("query").select(&all);
        assert_eq!(page.len(), 4);
        assert_eq!(next, None);
    }

    #[test]
    fn state_lists_user_and_active_filter() {
        let all = jobs(12);
        let (p, _) = q("state=succeeded,pending&user=bob")
            .expect("q")
            .select(&all);
        assert_eq!(p.iter().map(|j| j.0).collect::<Vec<_>>(), vec![3, 6, 9, 12]);
        let (p, _) = q("active=false").expect("q").select(&all);
        assert!(p.iter().all(|j| j.1 == JobState::Succeeded));
        assert_eq!(p.len(), 6);
    }

    #[test]
    fn bad_parameters_are_refused_naming_the_field() {
        assert_eq!(q("limit=0").unwrap_err().field, "limit");
        assert_eq!(q("limit=5001").unwrap_err().field, "limit");
        assert_eq!(q("state=pending,bogus").unwrap_err().field, "state");
        assert_eq!(q("cursor=zz").unwrap_err().field, "cursor");
        assert_eq!(q("cursor=").unwrap_err().field, "cursor");
        // A cursor from an ascending walk does not continue a descending one.
        assert_eq!(q("cursor=a5&desc=true").unwrap_err().field, "cursor");
        assert_eq!(
            q(&format!("user={}", "x".repeat(2000))).unwrap_err().field,
            "user"
        );
        assert!(q("limit=5000").is_ok());
    }
}
