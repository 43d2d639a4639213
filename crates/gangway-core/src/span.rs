//! Time spans as written in specs and on the command line (Slurm's `--time` forms).

use serde::{Deserialize, Serialize};

/// A time span as written in a spec: whole seconds (`5400`) or text
/// (`"01:30:00"`, `"1h30m"`, `"2-00:00:00"`, `"90m"`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum TimeSpan {
    /// Seconds.
    Seconds(u64),
    /// Text, parsed by [`parse_time_span`].
    Text(String),
}

impl TimeSpan {
    /// The span in seconds, or why it is not one.
    pub fn seconds(&self) -> Result<u64, String> {
        match self {
            TimeSpan::Seconds(s) => Ok(*s),
            TimeSpan::Text(t) => parse_time_span(t),
        }
    }
}

/// Parses `"5400"`, `"HH:MM:SS"`, `"MM:SS"`, `"D-HH:MM:SS"` (Slurm's
/// `--time`) or unit form `"1d2h30m15s"` into seconds; checked arithmetic.
pub fn parse_time_span(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let bad = || format!("{text:?} is not a duration (use seconds, \"HH:MM:SS\" or \"1h30m\")");
    if t.is_empty() {
        return Err(bad());
    }
    let num = |s: &str| -> Result<u64, String> {
        if s.is_empty() || !s.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        s.parse::<u64>().map_err(|_| bad())
    };
    let overflow = || format!("{text:?} is too long a duration");
    if t.chars().all(|c| c.is_ascii_digit()) {
        return num(t);
    }
    if t.contains(':') || t.contains('-') {
        let (days, rest) = match t.split_once('-') {
            Some((d, r)) => (num(d)?, r),
            None => (0, t),
        };
        let parts: Vec<&str> = rest.split(':').collect();
        let (h, m, s) = match parts.as_slice() {
            [h, m, s] => (num(h)?, num(m)?, num(s)?),
            [m, s] if days == 0 => (0, num(m)?, num(s)?),
            [h, m] => (num(h)?, num(m)?, 0),
            [h] if days > 0 => (num(h)?, 0, 0),
            _ => return Err(bad()),
        };
        if m >= 60 || s >= 60 || (days > 0 && h >= 24) {
            return Err(bad());
        }
        return days
            .checked_mul(86_400)
            .and_then(|d| h.checked_mul(3600).and_then(|h| d.checked_add(h)))
            .and_then(|x| x.checked_add(m * 60 + s))
            .ok_or_else(overflow);
    }
    let mut total: u64 = 0;
    let mut digits = String::new();
    let mut seen_unit = false;
    for c in t.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c.to_ascii_lowercase() {
            'd' => 86_400,
            'h' => 3600,
            'm' => 60,
            's' => 1,
            _ => return Err(bad()),
        };
        let n = num(&digits)?;
        digits.clear();
        seen_unit = true;
        total = n
            .checked_mul(unit)
            .and_then(|x| total.checked_add(x))
            .ok_or_else(overflow)?;
    }
    if !digits.is_empty() || !seen_unit {
        return Err(bad());
    }
    Ok(total)
}

/// Which of Gangway's two short forms [`format_span`] writes. Both give a
/// span in its largest whole unit, rounded down; they differ in where a
/// unit starts and in how hours carry minutes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanForm {
    /// Times relative to now in the CLI (`3m ago`, `in 1h57m`): a unit from
    /// one of it (`59s`, `1m`, `59m`, `1h`); minutes beside hours under 10
    /// hours when not 0 (`1h30m`, `2h`, `12h`); whole days from one day
    /// (`3d`). Short, since the exact time is shown beside it.
    Relative,
    /// Estimates in the scheduler's explanations (`t+90s`, `t+16m`,
    /// `t+2h05m`): a unit from two of it (`119s`, `2m`, `119m`), then hours
    /// with two-digit minutes and no days (`2h05m`, `30h00m`), so that an
    /// estimate keeps its minutes however far off it is.
    Estimate,
}

/// A span of seconds for people in the short form `form`: `42s`, `3m`,
/// `1h30m`, `5d` ([`SpanForm::Relative`]) or `90s`, `16m`, `2h05m`
/// ([`SpanForm::Estimate`]). The one formatter behind every such span
/// Gangway prints.
pub fn format_span(secs: u64, form: SpanForm) -> String {
    // A unit is used from `from` of it on.
    let from = match form {
        SpanForm::Relative => 1,
        SpanForm::Estimate => 2,
    };
    if secs < 60 * from {
        return format!("{secs}s");
    }
    if secs < 3_600 * from {
        return format!("{}m", secs / 60);
    }
    let (h, m) = (secs / 3_600, secs % 3_600 / 60);
    match form {
        SpanForm::Relative if secs >= 86_400 => format!("{}d", secs / 86_400),
        SpanForm::Relative if m == 0 || h >= 10 => format!("{h}h"),
        SpanForm::Relative => format!("{h}h{m}m"),
        SpanForm::Estimate => format!("{h}h{m:02}m"),
    }
}

/// `5400` → `"1:30:00"`, `93784` → `"1-02:03:04"` (Slurm's form).
pub fn format_time_span(secs: u64) -> String {
    let (d, rest) = (secs / 86_400, secs % 86_400);
    let (h, m, s) = (rest / 3600, rest % 3600 / 60, rest % 60);
    if d > 0 {
        format!("{d}-{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h}:{m:02}:{s:02}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both forms across every unit boundary of either: (seconds, relative,
    /// estimate). The CLI's relative times and the explanations' estimates
    /// (and their tests) read exactly these.
    #[test]
    fn both_short_forms_across_their_unit_boundaries() {
        let table = [
            (0, "0s", "0s"),
            (1, "1s", "1s"),
            (59, "59s", "59s"),
            (60, "1m", "60s"),
            (61, "1m", "61s"),
            (90, "1m", "90s"),
            (119, "1m", "119s"),
            (120, "2m", "2m"),
            (179, "2m", "2m"),
            (960, "16m", "16m"),
            (3599, "59m", "59m"),
            (3600, "1h", "60m"),
            (3660, "1h1m", "61m"),
            (5400, "1h30m", "90m"),
            (7019, "1h56m", "116m"),
            (7199, "1h59m", "119m"),
            (7200, "2h", "2h00m"),
            (7500, "2h5m", "2h05m"),
            (35999, "9h59m", "9h59m"),
            (36000, "10h", "10h00m"),
            (37800, "10h", "10h30m"),
            (86399, "23h", "23h59m"),
            (86400, "1d", "24h00m"),
            (93784, "1d", "26h03m"),
            (259205, "3d", "72h00m"),
            (1_000_000_000_000, "11574074d", "277777777h46m"),
        ];
        for (secs, relative, estimate) in table {
            assert_eq!(format_span(secs, SpanForm::Relative), relative, "{secs}");
            assert_eq!(format_span(secs, SpanForm::Estimate), estimate, "{secs}");
        }
        // No overflow at the end of the range.
        assert_eq!(
            format_span(u64::MAX, SpanForm::Relative),
            "213503982334601d"
        );
        assert!(format_span(u64::MAX, SpanForm::Estimate).ends_with('m'));
    }
}
