//! GPU discovery, health and topology, over a [`GpuSource`]: NVML where a
//! driver is present, a recorded machine (`--machine FILE`), or the
//! operator's declared inventory. Health follows NVIDIA's own device plugin:
//! application XIDs (a user's kernel fault) leave the GPU healthy; other
//! critical XIDs, a GPU lost from the bus, uncorrected ECC errors and row
//! remapping failures mark that GPU (and only it) unhealthy with the reason.
//! Either way an operator (or a health check outside Gangway) can mark GPUs
//! unhealthy in `<state_dir>/unhealthy-gpus`, one `INDEX [reason]` per line.

use crate::config::Inventory;
use crate::gpu_source::{GpuEvent, GpuSource, Nic, NvmlSource, SourceError};
use gangway_core::agent::GpuHealth;
use gangway_core::Gpu;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use thiserror::Error;

/// Why the node's GPUs could not be found.
#[derive(Debug, Error)]
pub enum DiscoveryError {
    /// NVML was asked for and failed.
    #[error("NVML: {0} (use a declared inventory, e.g. --gpus 8 --gpu-model H100, on machines without a driver)")]
    Nvml(String),
    /// The machine file is unusable.
    #[error("machine description {0}")]
    Machine(#[from] crate::machine::MachineError),
    /// The source answered the device list but not a device.
    #[error("{source_name}: GPU {index}: {error}")]
    Device {
        /// `nvml` or the machine file.
        source_name: String,
        /// NVML index.
        index: u32,
        /// What it said.
        error: SourceError,
    },
}

/// XIDs a user's own program causes (NVIDIA's device plugin skips the same):
/// 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped
/// processing, 45 preemptive cleanup, 68 video processor exception. The
/// job fails; the GPU is fine.
pub const APPLICATION_XIDS: [u64; 5] = [13, 31, 43, 45, 68];

/// What NVIDIA's XID catalogue says an XID means (the common critical ones).
pub fn xid_meaning(xid: u64) -> &'static str {
    match xid {
        13 => "graphics engine exception",
        31 => "GPU memory page fault",
        43 => "GPU stopped processing",
        45 => "preemptive cleanup, due to previous errors",
        48 => "double-bit ECC error",
        61 | 62 => "internal micro-controller error",
        63 => "ECC page retirement or row remapping recording event",
        64 => "ECC page retirement or row remapper recording failure",
        68 => "video processor exception",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        119 | 120 => "GSP error",
        _ => "critical error",
    }
}

/// The health verdict of one critical XID event: `None` leaves the GPU
/// healthy (an application XID), else the reason it is unhealthy.
pub fn xid_verdict(xid: Option<u64>) -> Option<String> {
    match xid {
        Some(x) if APPLICATION_XIDS.contains(&x) => None,
        Some(x) => Some(format!("XID {x}: {}", xid_meaning(x))),
        None => Some("critical XID error (no number reported)".into()),
    }
}

/// What the node has around its GPUs: NUMA nodes, NICs and PCI positions.
#[derive(Clone, Debug, Default)]
pub struct Topology {
    /// CPUs of each NUMA node.
    pub numa_cpus: BTreeMap<u32, Vec<u32>>,
    /// InfiniBand/RoCE adapters.
    pub nics: Vec<Nic>,
    /// Each GPU's sysfs PCI path, by position in `gpus`.
    pub gpu_paths: Vec<Option<String>>,
    /// MIG instance profiles of each GPU, by position.
    pub mig_instances: Vec<Vec<String>>,
}

/// What the per-GPU event watches found: sticky verdicts until an admin
/// clears the GPU on the server, and watches that could not run.
#[derive(Debug, Default)]
struct Watched {
    unhealthy: BTreeMap<u32, String>,
    watch_errors: BTreeMap<u32, String>,
    /// Application XIDs seen (they change nothing but are worth a look).
    application_xids: BTreeMap<u32, u64>,
}

/// The node's GPUs and how to check their health.
pub struct Discovery {
    /// The GPUs.
    pub gpus: Vec<Gpu>,
    /// `declared`, `nvml` or `machine FILE`.
    pub source: String,
    /// NUMA, NICs and PCI positions.
    pub topology: Topology,
    src: Option<Arc<dyn GpuSource>>,
    watched: Arc<Mutex<Watched>>,
}

impl std::fmt::Debug for Discovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discovery")
            .field("gpus", &self.gpus)
            .field("source", &self.source)
            .finish()
    }
}

fn declared(gpus: u32, model: &str, memory_gib: u32, nvlink_all: bool) -> Vec<Gpu> {
    (0..gpus)
        .map(|index| Gpu {
            index,
            model: model.to_string(),
            memory_gib,
            island: if nvlink_all { 0 } else { index },
            ..Gpu::default()
        })
        .collect()
}

/// NVLink islands: GPUs that reach each other, directly (a peer is another
/// GPU's bus id) or through a shared switch (the same non-GPU peer), are one
/// island, numbered by its lowest GPU index. A GPU without links is alone.
pub fn islands(bus_ids: &[String], peers: &[Vec<String>]) -> Vec<u32> {
    fn find(p: &mut [usize], mut x: usize) -> usize {
        while p[x] != x {
            p[x] = p[p[x]];
            x = p[x];
        }
        x
    }
    let n = bus_ids.len();
    let mut parent: Vec<usize> = (0..n).collect();
    let norm = |s: &str| s.trim().to_ascii_lowercase();
    let by_bus: BTreeMap<String, usize> = bus_ids
        .iter()
        .enumerate()
        .map(|(i, b)| (norm(b), i))
        .collect();
    let mut by_switch: BTreeMap<String, usize> = BTreeMap::new();
    for (i, ps) in peers.iter().enumerate().take(n) {
        for p in ps {
            let p = norm(p);
            let other = match by_bus.get(&p) {
                Some(j) => *j,
                None => *by_switch.entry(p).or_insert(i),
            };
            let (a, b) = (find(&mut parent, i), find(&mut parent, other));
            if a != b {
                parent[a.max(b)] = a.min(b);
            }
        }
    }
    (0..n).map(|i| find(&mut parent, i) as u32).collect()
}

/// Reads every GPU's facts from `src`.
fn from_source(src: &dyn GpuSource) -> Result<(Vec<Gpu>, Topology), DiscoveryError> {
    let err = |index, error| DiscoveryError::Device {
        source_name: src.describe(),
        index,
        error,
    };
    let count = src.device_count().map_err(|e| err(u32::MAX, e))?;
    let mut facts = Vec::new();
    for i in 0..count {
        facts.push(src.device(i).map_err(|e| err(i, e))?);
    }
    let bus: Vec<String> = facts.iter().map(|f| f.pci_bus_id.clone()).collect();
    let peers: Vec<Vec<String>> = facts.iter().map(|f| f.nvlink_peers.clone()).collect();
    let island = islands(&bus, &peers);
    let gpus = facts
        .iter()
        .enumerate()
        .map(|(i, f)| Gpu {
            index: i as u32,
            model: f.name.clone(),
            memory_gib: u32::try_from(f.memory_bytes >> 30).unwrap_or(u32::MAX),
            island: island[i],
            memory_mib: Some(f.memory_bytes >> 20),
            uuid: Some(f.uuid.clone()),
            pci_bus_id: Some(f.pci_bus_id.clone()),
            numa_node: f.numa_node,
            mig: f.mig_enabled,
            ..Gpu::default()
        })
        .collect();
    let topology = Topology {
        numa_cpus: src.numa_cpus(),
        nics: src.nics(),
        gpu_paths: (0..count).map(|i| src.pci_path(i)).collect(),
        mig_instances: facts.iter().map(|f| f.mig_instances.clone()).collect(),
    };
    Ok((gpus, topology))
}

/// Records one watch result; false once the discovery is gone.
fn record(
    weak: &Weak<Mutex<Watched>>,
    i: u32,
    got: &Result<Option<GpuEvent>, SourceError>,
) -> bool {
    let Some(w) = weak.upgrade() else {
        return false;
    };
    let Ok(mut w) = w.lock() else {
        return false;
    };
    match got {
        Ok(Some(GpuEvent::Xid(x))) => match xid_verdict(*x) {
            Some(reason) => {
                tracing::error!("GPU {i}: {reason}");
                w.unhealthy.entry(i).or_insert(reason);
            }
            None => {
                let x = x.unwrap_or(0);
                tracing::warn!(
                    "GPU {i}: XID {x} ({}), an application error: the GPU stays healthy",
                    xid_meaning(x)
                );
                w.application_xids.insert(i, x);
            }
        },
        Ok(None) => {}
        Err(SourceError::Lost(e)) => {
            tracing::error!("GPU {i}: {e}");
            w.unhealthy.insert(i, format!("GPU lost: {e}"));
        }
        Err(e) => {
            tracing::warn!("GPU {i}: event watch ended: {e}; the other GPUs stay watched");
            w.watch_errors.insert(i, e.to_string());
        }
    }
    true
}

/// Watches each GPU's critical events on a thread of its own, so a GPU whose
/// registration fails (or whose watch ends) leaves the others watched. A
/// thread ends when its GPU is lost or the discovery is dropped.
fn watch_events(src: &Arc<dyn GpuSource>, count: u32, watched: &Arc<Mutex<Watched>>) {
    for i in 0..count {
        let src = Arc::clone(src);
        let weak = Arc::downgrade(watched);
        let spawned = std::thread::Builder::new()
            .name(format!("gpu{i}-events"))
            .spawn(move || {
                let mut watch = match src.watch(i) {
                    Ok(w) => w,
                    Err(e) => {
                        record(
                            &weak,
                            i,
                            &Err(SourceError::Other(format!("no XID events: {e}"))),
                        );
                        return;
                    }
                };
                loop {
                    let got = watch.wait(Duration::from_secs(2));
                    if !record(&weak, i, &got) || got.is_err() {
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start GPU {i}'s event watch: {e}");
        }
    }
}

fn with_source(src: Arc<dyn GpuSource>) -> Result<Discovery, DiscoveryError> {
    let (gpus, topology) = from_source(src.as_ref())?;
    let watched = Arc::default();
    watch_events(&src, gpus.len() as u32, &watched);
    Ok(Discovery {
        gpus,
        source: src.describe(),
        topology,
        src: Some(src),
        watched,
    })
}

/// Finds the node's GPUs.
pub fn discover(inv: &Inventory) -> Result<Discovery, DiscoveryError> {
    match inv {
        Inventory::Declared {
            gpus,
            model,
            memory_gib,
            nvlink_all,
        } => Ok(Discovery {
            gpus: declared(*gpus, model, *memory_gib, *nvlink_all),
            source: "declared".into(),
            topology: Topology::default(),
            src: None,
            watched: Arc::default(),
        }),
        Inventory::Machine(path) => {
            let m = crate::machine::RecordedMachine::load(path)?;
            with_source(Arc::new(m))
        }
        Inventory::Nvml => {
            let nvml = NvmlSource::init().map_err(|e| DiscoveryError::Nvml(e.to_string()))?;
            with_source(Arc::new(nvml))
        }
        Inventory::Auto(fallback) => match discover(&Inventory::Nvml) {
            Ok(d) => Ok(d),
            Err(e) => {
                tracing::info!("{e}; using the declared inventory");
                discover(fallback)
            }
        },
    }
}

/// Reads `INDEX [reason]` lines; anything unparsable is ignored with a warning.
pub fn read_health_file(path: &Path) -> BTreeMap<u32, String> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (idx, reason) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        match idx.parse::<u32>() {
            Ok(i) => {
                let reason = if reason.trim().is_empty() {
                    "marked unhealthy in the health file".to_string()
                } else {
                    reason.trim().to_string()
                };
                out.insert(i, reason);
            }
            Err(_) => tracing::warn!("{}: ignoring line {line:?}", path.display()),
        }
    }
    out
}

impl Discovery {
    /// Every GPU's health now: the health file, what the event watches saw
    /// (sticky), and the source's answer now (lost, ECC, row remapping).
    pub fn health(&self, state_dir: &Path) -> Vec<GpuHealth> {
        let marked = read_health_file(&state_dir.join("unhealthy-gpus"));
        self.gpus
            .iter()
            .map(|g| {
                let mut reason = marked.get(&g.index).cloned();
                if reason.is_none() {
                    reason = self
                        .watched
                        .lock()
                        .ok()
                        .and_then(|w| w.unhealthy.get(&g.index).cloned());
                }
                if let (None, Some(src)) = (&reason, &self.src) {
                    reason = match src.state(g.index) {
                        Err(SourceError::Lost(e)) => Some(format!("GPU lost: {e}")),
                        Err(SourceError::NotSupported(_)) => None,
                        Err(e) => Some(format!("NVML cannot reach the device: {e}")),
                        Ok(s) if s.remap_failed => {
                            Some("row remapping failed: the GPU's memory cannot be repaired".into())
                        }
                        Ok(s) if s.ecc_uncorrected > 0 => {
                            Some(format!("{} uncorrected ECC errors", s.ecc_uncorrected))
                        }
                        Ok(s) if s.remap_pending => {
                            Some("row remapping pending: the GPU needs a reset".into())
                        }
                        Ok(_) => None,
                    };
                }
                GpuHealth {
                    index: g.index,
                    healthy: reason.is_none(),
                    reason,
                }
            })
            .collect()
    }

    /// GPUs whose event watch could not start or ended, with why.
    pub fn watch_errors(&self) -> BTreeMap<u32, String> {
        self.watched
            .lock()
            .map(|w| w.watch_errors.clone())
            .unwrap_or_default()
    }

    /// The last application XID seen per GPU (it left the GPU healthy).
    pub fn application_xids(&self) -> BTreeMap<u32, u64> {
        self.watched
            .lock()
            .map(|w| w.application_xids.clone())
            .unwrap_or_default()
    }
}

/// The machine's CPU in thousandths of a core and memory in MiB.
pub fn machine_size() -> (u64, u64) {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let mem_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .unwrap_or(0);
    (cpus * 1000, mem_kib / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_inventory_and_health_file() {
        let d = discover(&Inventory::Declared {
            gpus: 4,
            model: "A100".into(),
            memory_gib: 40,
            nvlink_all: false,
        })
        .expect("declared");
        assert_eq!(d.gpus.len(), 4);
        assert_eq!(d.gpus[3].island, 3, "no NVLink: every GPU its own island");
        let dir = tempfile::tempdir().expect("tmp");
        assert!(d.health(dir.path()).iter().all(|g| g.healthy));
        std::fs::write(
            dir.path().join("unhealthy-gpus"),
            "2 XID 79 fell off the bus\nbogus\n",
        )
        .expect("write");
        let h = d.health(dir.path());
        assert!(!h[2].healthy);
        assert_eq!(h[2].reason.as_deref(), Some("XID 79 fell off the bus"));
        assert!(h[0].healthy && h[1].healthy && h[3].healthy);
    }

    #[test]
    fn auto_falls_back_to_the_declaration_without_a_driver() {
        let inv = Inventory::Auto(Box::new(Inventory::Declared {
            gpus: 2,
            model: "H100".into(),
            memory_gib: 80,
            nvlink_all: true,
        }));
        let d = discover(&inv).expect("some inventory");
        assert!(!d.gpus.is_empty());
    }
}
