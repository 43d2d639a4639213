//! Integer resource vectors. GPUs are whole devices: there is no fractional GPU.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign, Mul, Sub};

/// One kind of schedulable resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resource {
    /// Whole GPUs.
    Gpus,
    /// CPU in thousandths of a core.
    CpuMillis,
    /// Memory in MiB.
    MemoryMib,
}

impl Resource {
    /// Every resource, in a fixed order.
    pub const ALL: [Resource; 3] = [Resource::Gpus, Resource::CpuMillis, Resource::MemoryMib];

    /// Unit suffix used in human-readable messages.
    pub fn unit(self) -> &'static str {
        match self {
            Resource::Gpus => "GPUs",
            Resource::CpuMillis => "mCPU",
            Resource::MemoryMib => "MiB",
        }
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Resource::Gpus => "gpus",
            Resource::CpuMillis => "cpu",
            Resource::MemoryMib => "memory",
        })
    }
}

/// An amount of each resource; all integers, so sums never drift.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Resources {
    /// Whole GPUs.
    pub gpus: u64,
    /// CPU in thousandths of a core.
    pub cpu_millis: u64,
    /// Memory in MiB.
    pub memory_mib: u64,
}

impl Resources {
    /// No resources at all.
    pub const ZERO: Resources = Resources {
        gpus: 0,
        cpu_millis: 0,
        memory_mib: 0,
    };

    /// A vector with only GPUs set.
    pub fn gpus(gpus: u64) -> Self {
        Resources { gpus, ..Self::ZERO }
    }

    /// The amount of one resource.
    pub fn get(&self, r: Resource) -> u64 {
        match r {
            Resource::Gpus => self.gpus,
            Resource::CpuMillis => self.cpu_millis,
            Resource::MemoryMib => self.memory_mib,
        }
    }

    /// A mutable reference to one resource's amount.
    pub fn get_mut(&mut self, r: Resource) -> &mut u64 {
        match r {
            Resource::Gpus => &mut self.gpus,
            Resource::CpuMillis => &mut self.cpu_millis,
            Resource::MemoryMib => &mut self.memory_mib,
        }
    }

    /// True when every component of `self` is at most the one in `other`.
    pub fn fits_in(&self, other: &Resources) -> bool {
        self.gpus <= other.gpus
            && self.cpu_millis <= other.cpu_millis
            && self.memory_mib <= other.memory_mib
    }

    /// Component-wise subtraction that stops at zero.
    pub fn saturating_sub(&self, other: &Resources) -> Resources {
        Resources {
            gpus: self.gpus.saturating_sub(other.gpus),
            cpu_millis: self.cpu_millis.saturating_sub(other.cpu_millis),
            memory_mib: self.memory_mib.saturating_sub(other.memory_mib),
        }
    }

    /// Component-wise subtraction; `None` if any component would go negative.
    pub fn checked_sub(&self, other: &Resources) -> Option<Resources> {
        Some(Resources {
            gpus: self.gpus.checked_sub(other.gpus)?,
            cpu_millis: self.cpu_millis.checked_sub(other.cpu_millis)?,
            memory_mib: self.memory_mib.checked_sub(other.memory_mib)?,
        })
    }

    /// Dominant share of `self` against `capacity` (DRF): the largest fraction
    /// of any resource it holds. Resources the cluster lacks are ignored.
    pub fn dominant_share(&self, capacity: &Resources) -> f64 {
        Resource::ALL
            .iter()
            .filter(|r| capacity.get(**r) > 0)
            .map(|r| self.get(*r) as f64 / capacity.get(*r) as f64)
            .fold(0.0, f64::max)
    }
}

impl Add for Resources {
    type Output = Resources;
    fn add(self, o: Resources) -> Resources {
        Resources {
            gpus: self.gpus + o.gpus,
            cpu_millis: self.cpu_millis + o.cpu_millis,
            memory_mib: self.memory_mib + o.memory_mib,
        }
    }
}

impl AddAssign for Resources {
    fn add_assign(&mut self, o: Resources) {
        *self = *self + o;
    }
}

impl Sub for Resources {
    type Output = Resources;
    /// Saturating: resource amounts are never negative.
    fn sub(self, o: Resources) -> Resources {
        self.saturating_sub(&o)
    }
}

impl Mul<u64> for Resources {
    type Output = Resources;
    fn mul(self, n: u64) -> Resources {
        Resources {
            gpus: self.gpus * n,
            cpu_millis: self.cpu_millis * n,
            memory_mib: self.memory_mib * n,
        }
    }
}

impl fmt::Display for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} GPUs, {} mCPU, {} MiB",
            self.gpus, self.cpu_millis, self.memory_mib
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_is_componentwise_and_never_negative() {
        let a = Resources {
            gpus: 4,
            cpu_millis: 1000,
            memory_mib: 10,
        };
        let b = Resources {
            gpus: 6,
            cpu_millis: 500,
            memory_mib: 10,
        };
        assert_eq!((a - b).gpus, 0);
        assert_eq!((a - b).cpu_millis, 500);
        assert_eq!(a.checked_sub(&b), None);
        assert!(!b.fits_in(&a));
        assert!(Resources::gpus(4).fits_in(&a));
        assert_eq!((a * 2).gpus, 8);
    }

    #[test]
    fn dominant_share_takes_the_largest_fraction() {
        let cap = Resources {
            gpus: 10,
            cpu_millis: 100,
            memory_mib: 0,
        };
        let u = Resources {
            gpus: 1,
            cpu_millis: 50,
            memory_mib: 7,
        };
        assert!((u.dominant_share(&cap) - 0.5).abs() < 1e-12);
    }
}
