//! Run-time knowledge from history: a Helios-style predictor learned online
//! from completed jobs.
//!
//! Helios (Hu et al., SC '21, "Characterization and Prediction of Deep
//! Learning Workloads in Large-Scale GPU Datacenters") predicts a job's
//! duration from earlier jobs of the same user with the same name and GPU
//! demand, falling back to coarser groups. Here every completed run time is
//! folded into running log-space statistics (Welford) at several levels, from
//! the most specific (user, name, GPUs) to the whole cluster; a prediction
//! comes from the most specific level with enough samples, as a log-normal
//! (median and spread), so callers get an uncertainty with every estimate.
//!
//! The type is plain data (serde), pure and deterministic: the server can
//! persist it, and the simulator feeds it only completions that happened
//! before each decision (causal).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a prediction is keyed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobKey<'a> {
    /// Submitting user.
    pub user: &'a str,
    /// Job name.
    pub name: &'a str,
    /// Queue.
    pub queue: &'a str,
    /// Total GPUs of the gang.
    pub gpus: u64,
}

/// Which group of past jobs a prediction came from, most specific first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Basis {
    /// Same user, same name, same GPU count.
    UserNameGpus,
    /// Same user, same name.
    UserName,
    /// Same user, same GPU count.
    UserGpus,
    /// Same queue, same GPU count.
    QueueGpus,
    /// Same user.
    User,
    /// Same queue.
    Queue,
    /// Every completed job.
    Cluster,
}

impl Basis {
    const ALL: [Basis; 7] = [
        Basis::UserNameGpus,
        Basis::UserName,
        Basis::UserGpus,
        Basis::QueueGpus,
        Basis::User,
        Basis::Queue,
        Basis::Cluster,
    ];

    fn key(self, k: &JobKey<'_>) -> String {
        // '\u{1f}' (unit separator) cannot be confused with a name's characters.
        match self {
            Basis::UserNameGpus => format!("{}\u{1f}{}\u{1f}{}", k.user, k.name, k.gpus),
            Basis::UserName => format!("{}\u{1f}{}", k.user, k.name),
            Basis::UserGpus => format!("{}\u{1f}{}", k.user, k.gpus),
            Basis::QueueGpus => format!("{}\u{1f}{}", k.queue, k.gpus),
            Basis::User => k.user.to_string(),
            Basis::Queue => k.queue.to_string(),
            Basis::Cluster => String::new(),
        }
    }
}

/// Running statistics of ln(run time) (Welford's algorithm).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LogStats {
    /// Samples.
    pub n: u64,
    /// Mean of ln(seconds).
    pub mean: f64,
    /// Sum of squared deviations from the mean.
    pub m2: f64,
}

impl LogStats {
    fn add(&mut self, x: f64) {
        self.n += 1;
        let d = x - self.mean;
        self.mean += d / self.n as f64;
        self.m2 += d * (x - self.mean);
    }

    fn sd(&self, prior_sd: f64) -> f64 {
        // Few samples say little about the spread: shrink towards the prior.
        let k = 2.0;
        let n = self.n as f64;
        let sample_var = if self.n > 1 { self.m2 / (n - 1.0) } else { 0.0 };
        let var =
            ((n - 1.0).max(0.0) * sample_var + k * prior_sd * prior_sd) / ((n - 1.0).max(0.0) + k);
        var.sqrt()
    }
}

/// A predicted run time: a log-normal with its median and spread.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Mean of ln(seconds).
    pub log_mean: f64,
    /// Standard deviation of ln(seconds): the uncertainty.
    pub log_sd: f64,
    /// Past jobs it rests on.
    pub samples: u64,
    /// Which group they came from.
    pub basis: Basis,
}

impl Prediction {
    /// Median run time, seconds (at least 1).
    pub fn median(&self) -> u64 {
        secs(self.log_mean)
    }

    /// The run time that `q` of such jobs stay under (e.g. 0.9), seconds.
    pub fn quantile(&self, q: f64) -> u64 {
        secs(self.log_mean + self.log_sd * inv_norm(q.clamp(1e-6, 1.0 - 1e-6)))
    }

    /// Median of the *remaining* run time of a job that has already run
    /// `elapsed` seconds (conditional on it not having ended), seconds. A job
    /// that outlives its estimate is not assumed to end right away.
    pub fn remaining_median(&self, elapsed: u64) -> u64 {
        self.remaining_quantile(elapsed, 0.5)
    }

    /// The `q` quantile of the remaining run time after `elapsed` seconds.
    pub fn remaining_quantile(&self, elapsed: u64, q: f64) -> u64 {
        let e = elapsed.max(1) as f64;
        if self.log_sd < 1e-6 {
            return self.quantile(q).saturating_sub(elapsed).max(1);
        }
        // P(T > t | T > e) = 1 - q  <=>  S(t) = (1 - q) S(e).
        let z_e = (e.ln() - self.log_mean) / self.log_sd;
        let surv_e = 1.0 - norm_cdf(z_e);
        let target = (1.0 - q) * surv_e;
        let total = if target <= 1e-300 {
            // Far in the tail: fall back to "as long again as it has run".
            2.0 * e
        } else {
            let z = inv_norm((1.0 - target).clamp(1e-12, 1.0 - 1e-12));
            (self.log_mean + self.log_sd * z).exp().max(e + 1.0)
        };
        ((total - e).round().max(1.0)).min(u64::MAX as f64 / 4.0) as u64
    }
}

fn secs(log: f64) -> u64 {
    log.exp().round().clamp(1.0, u64::MAX as f64 / 4.0) as u64
}

/// Standard normal CDF (Abramowitz–Stegun 7.1.26 on erf; error < 1.5e-7).
fn norm_cdf(z: f64) -> f64 {
    let x = z.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let y = 1.0
        - (((((1.061_405_429 * t - 1.453_152_027) * t) + 1.421_413_741) * t - 0.284_496_736) * t
            + 0.254_829_592)
            * t
            * (-x * x).exp();
    if z >= 0.0 {
        0.5 * (1.0 + y)
    } else {
        0.5 * (1.0 - y)
    }
}

/// Inverse standard normal CDF (Acklam's rational approximation, rel. error < 1.2e-9).
fn inv_norm(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let lo = 0.024_25;
    if p < lo {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - lo {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        let q = (-2.0 * (1.0 - p).ln()).sqrt();
        -(((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    }
}

/// Learns run times from completed jobs and predicts those of new ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuntimePredictor {
    /// Per basis: statistics per group key.
    groups: BTreeMap<Basis, BTreeMap<String, LogStats>>,
    /// Samples a group needs before it is used (the cluster-wide group needs one).
    pub min_samples: u64,
    /// Spread assumed for groups with few samples (ln-space standard deviation).
    pub prior_log_sd: f64,
    /// Most distinct keys kept per basis; beyond it new keys are not learned
    /// (memory stays bounded in a long-lived server).
    pub max_keys: usize,
}

impl Default for RuntimePredictor {
    fn default() -> Self {
        RuntimePredictor {
            groups: BTreeMap::new(),
            min_samples: 2,
            // Philly's run times span about 1.5 decades per user; e^1.5 ≈ 4.5×.
            prior_log_sd: 1.5,
            max_keys: 1_000_000,
        }
    }
}

impl RuntimePredictor {
    /// An empty predictor.
    pub fn new() -> Self {
        Self::default()
    }

    /// Learns from a job that completed after running `seconds` (successful
    /// runs only: a failure says little about how long the work takes).
    pub fn observe(&mut self, key: &JobKey<'_>, seconds: u64) {
        let x = (seconds.max(1) as f64).ln();
        let max_keys = self.max_keys;
        for b in Basis::ALL {
            let g = self.groups.entry(b).or_default();
            let k = b.key(key);
            if let Some(s) = g.get_mut(&k) {
                s.add(x);
            } else if g.len() < max_keys {
                let mut s = LogStats::default();
                s.add(x);
                g.insert(k, s);
            }
        }
    }

    /// A copy keeping, per basis, only the `keep` groups with the most
    /// samples (ties by key), and every group of the cluster-wide basis:
    /// what is stored when the whole would not fit the store's values
    /// (etcd's requests are at most 1.5 MiB by default). The groups dropped
    /// are those with the least history, which predict least.
    pub fn keep_largest(&self, keep: usize) -> RuntimePredictor {
        let groups = self
            .groups
            .iter()
            .map(|(b, g)| {
                if *b == Basis::Cluster || g.len() <= keep {
                    return (*b, g.clone());
                }
                let mut by_size: Vec<(&String, &LogStats)> = g.iter().collect();
                by_size.sort_by(|x, y| y.1.n.cmp(&x.1.n).then_with(|| x.0.cmp(y.0)));
                by_size.truncate(keep);
                let kept = by_size.into_iter().map(|(k, v)| (k.clone(), *v)).collect();
                (*b, kept)
            })
            .collect();
        RuntimePredictor {
            groups,
            ..self.clone()
        }
    }

    /// The most groups any basis holds.
    pub fn widest_basis(&self) -> usize {
        self.groups.values().map(BTreeMap::len).max().unwrap_or(0)
    }

    /// Completed jobs learned from.
    pub fn samples(&self) -> u64 {
        self.groups
            .get(&Basis::Cluster)
            .and_then(|g| g.get(""))
            .map_or(0, |s| s.n)
    }

    /// Predicts the run time of a job with `key`, from the most specific group
    /// with enough history; `None` before any job has completed.
    pub fn predict(&self, key: &JobKey<'_>) -> Option<Prediction> {
        for b in Basis::ALL {
            let need = if b == Basis::Cluster {
                1
            } else {
                self.min_samples
            };
            let Some(s) = self.groups.get(&b).and_then(|g| g.get(&b.key(key))) else {
                continue;
            };
            if s.n >= need {
                return Some(Prediction {
                    log_mean: s.mean,
                    log_sd: s.sd(self.prior_log_sd),
                    samples: s.n,
                    basis: b,
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(user: &'a str, name: &'a str, gpus: u64) -> JobKey<'a> {
        JobKey {
            user,
            name,
            queue: "q",
            gpus,
        }
    }

    #[test]
    fn nothing_is_predicted_before_history() {
        assert_eq!(RuntimePredictor::new().predict(&key("u", "n", 1)), None);
    }

    #[test]
    fn the_most_specific_group_with_history_wins() {
        let mut p = RuntimePredictor::new();
        for _ in 0..3 {
            p.observe(&key("alice", "resnet", 8), 7200);
            p.observe(&key("bob", "bert", 1), 60);
        }
        let a = p.predict(&key("alice", "resnet", 8)).expect("history");
        assert_eq!(a.basis, Basis::UserNameGpus);
        assert_eq!(a.median(), 7200);
        // Same user and name, new size: the user-name group.
        let b = p.predict(&key("alice", "resnet", 4)).expect("history");
        assert_eq!((b.basis, b.median()), (Basis::UserName, 7200));
        // A stranger: the cluster-wide geometric mean, sqrt(7200 * 60).
        let c = p.predict(&key("carol", "x", 2)).expect("history");
        assert_eq!(c.basis, Basis::Queue);
        assert_eq!(c.median(), (7200f64 * 60.0).sqrt().round() as u64);
    }

    #[test]
    fn uncertainty_shrinks_with_consistent_history_and_grows_with_spread() {
        let mut tight = RuntimePredictor::new();
        let mut wide = RuntimePredictor::new();
        for i in 0..20 {
            tight.observe(&key("u", "n", 1), 1000 + i);
            wide.observe(&key("u", "n", 1), if i % 2 == 0 { 100 } else { 10_000 });
        }
        let t = tight.predict(&key("u", "n", 1)).expect("history");
        let w = wide.predict(&key("u", "n", 1)).expect("history");
        assert!(t.log_sd < 0.6, "{}", t.log_sd);
        assert!(w.log_sd > 2.0, "{}", w.log_sd);
        assert!(t.quantile(0.9) < 2000);
        assert!(w.quantile(0.9) > 10_000);
    }

    #[test]
    fn an_overrunning_job_is_not_assumed_to_end_now() {
        let p = Prediction {
            log_mean: (600f64).ln(),
            log_sd: 1.0,
            samples: 10,
            basis: Basis::User,
        };
        assert!((p.remaining_median(0) as i64 - 600).abs() <= 1);
        // Past its median, it still has a good while to go, and more the longer it ran.
        let r1 = p.remaining_median(1200);
        let r2 = p.remaining_median(12_000);
        assert!(r1 > 300, "{r1}");
        assert!(r2 > r1, "{r2} vs {r1}");
    }

    #[test]
    fn normal_helpers_agree() {
        for p in [0.01, 0.1, 0.5, 0.9, 0.99] {
            assert!((norm_cdf(inv_norm(p)) - p).abs() < 1e-6, "{p}");
        }
    }
}
