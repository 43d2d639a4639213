//! Job ids as users type them: `12`, or an array task's `5_7` (Slurm's
//! `ARRAYID_INDEX`, as `gangway queue` prints it). Every command that takes
//! a job id parses it here and resolves it to the task's own job id.
//! (A leaf module: it reads jobs through the function it is given.)

use anyhow::{bail, Result};
use serde_json::Value;

/// `ARRAY_INDEX` of an array task (Slurm's `1234_7`), empty for other jobs.
pub fn array_label(job: &Value) -> String {
    match (job.pointer("/array/job"), job.pointer("/array/index")) {
        (Some(j), Some(i)) => format!("{j}_{i}"),
        _ => String::new(),
    }
}

/// A job id as typed: `ID` or `ID_INDEX`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobRef {
    /// The job id, or the array's id (its first task's) with `index`.
    pub id: u64,
    /// The array task's index (`SLURM_ARRAY_TASK_ID`).
    pub index: Option<u32>,
}

/// A job id that is neither `ID` nor `ID_INDEX`.
#[derive(Debug, thiserror::Error)]
#[error("job id {0:?}: expected ID or ID_INDEX (e.g. 12 or 5_7)")]
pub struct BadJobRef(String);

impl std::str::FromStr for JobRef {
    type Err = BadJobRef;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadJobRef(s.to_string());
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        let (id, index) = match s.split_once('_') {
            Some((i, x)) => (i, Some(x)),
            None => (s, None),
        };
        if !digits(id) || index.is_some_and(|x| !digits(x)) {
            return Err(bad());
        }
        Ok(JobRef {
            id: id.parse().map_err(|_| bad())?,
            index: index.map(str::parse).transpose().map_err(|_| bad())?,
        })
    }
}

impl std::fmt::Display for JobRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.index {
            Some(i) => write!(f, "{}_{i}", self.id),
            None => write!(f, "{}", self.id),
        }
    }
}

/// A [`JobRef`] resolved against the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// The job's own id (an array task's id).
    pub id: u64,
    /// True when the user named one task (`5_0`): the server must then act
    /// on that task only, not on the array whose id it shares.
    pub task: bool,
}

impl Target {
    /// The query string that keeps an array's id to its one task.
    pub fn query(&self) -> &'static str {
        if self.task {
            "?task=true"
        } else {
            ""
        }
    }
}

/// The `/array` of a job record: (array id, index, count).
fn array_of(job: &Value) -> Option<(u64, u64, u64)> {
    let a = job.get("array").filter(|a| !a.is_null())?;
    Some((
        a.get("job")?.as_u64()?,
        a.get("index")?.as_u64()?,
        a.get("count")?.as_u64()?,
    ))
}

impl JobRef {
    /// The job id the server knows this by. An array's tasks have the
    /// consecutive ids `array .. array + count` in index order, so `ID_INDEX`
    /// is found by a guess (dense arrays) and then a binary search.
    /// `get` reads a job's record (`GET /v1/jobs/{id}`).
    pub fn resolve_with(&self, get: impl Fn(u64) -> Result<Value>) -> Result<Target> {
        let Some(want) = self.index.map(u64::from) else {
            return Ok(Target {
                id: self.id,
                task: false,
            });
        };
        let first = get(self.id)?;
        let (array, first_index, count) = match array_of(&first) {
            Some((a, i, n)) if a == self.id => (a, i, n),
            Some((a, i, _)) => bail!(
                "job {} is task {a}_{i}, not an array: use {} or {a}_{i}",
                self.id,
                self.id
            ),
            None => bail!("job {} is not an array: use {}", self.id, self.id),
        };
        let missing = || anyhow::anyhow!("array {array} has no task {want}");
        let index_at = |pos: u64| -> Result<u64> {
            let id = array.checked_add(pos).ok_or_else(missing)?;
            let j = get(id)?;
            match array_of(&j) {
                Some((a, i, _)) if a == array => Ok(i),
                _ => Err(missing()),
            }
        };
        if want == first_index {
            return Ok(Target {
                id: array,
                task: true,
            });
        }
        if want < first_index {
            return Err(missing());
        }
        // Dense arrays (`0-99`): the task is where its index says.
        let guess = want - first_index;
        if guess < count && index_at(guess)? == want {
            return Ok(Target {
                id: array + guess,
                task: true,
            });
        }
        // Sparse ones (`1,3,5-9`, `0-30:10`): indexes rise with the ids.
        let (mut lo, mut hi) = (1u64, count.min(guess.saturating_add(1)));
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match index_at(mid)?.cmp(&want) {
                std::cmp::Ordering::Equal => {
                    return Ok(Target {
                        id: array + mid,
                        task: true,
                    })
                }
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
            }
        }
        Err(missing())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_array_task_ids_parse_and_anything_else_is_refused_by_name() {
        assert_eq!(
            "12".parse::<JobRef>().expect("id"),
            JobRef {
                id: 12,
                index: None
            }
        );
        assert_eq!(
            "5_7".parse::<JobRef>().expect("task"),
            JobRef {
                id: 5,
                index: Some(7)
            }
        );
        assert_eq!("5_7".parse::<JobRef>().expect("task").to_string(), "5_7");
        for bad in [
            "5_x",
            "",
            "_3",
            "5_",
            "5_1_2",
            "-1",
            "+3",
            "5_-1",
            "5_99999999999",
            "99999999999999999999999",
            " 5",
        ] {
            let e = bad.parse::<JobRef>().expect_err(bad).to_string();
            assert_eq!(
                e,
                format!("job id {bad:?}: expected ID or ID_INDEX (e.g. 12 or 5_7)")
            );
        }
    }
}
