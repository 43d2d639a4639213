//! GPU discovery and health: NVML where a driver is present (uncorrected ECC
//! errors, critical XID events, a device that stops answering), otherwise the
//! operator's declared inventory. Either way an operator (or a health check
//! outside Gangway) can mark GPUs unhealthy in `<state_dir>/unhealthy-gpus`,
//! one `INDEX [reason]` per line.

use crate::config::Inventory;
use gangway_core::agent::GpuHealth;
use gangway_core::Gpu;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::Nvml;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use thiserror::Error;

/// Why the node's GPUs could not be found.
#[derive(Debug, Error)]
pub enum DiscoveryError {
    /// NVML was asked for and failed.
    #[error("NVML: {0} (use a declared inventory, e.g. --gpus 8 --gpu-model H100, on machines without a driver)")]
    Nvml(String),
}

/// The node's GPUs and how to check their health.
pub struct Discovery {
    /// The GPUs.
    pub gpus: Vec<Gpu>,
    /// `nvml` or `declared`.
    pub source: &'static str,
    nvml: Option<Nvml>,
    /// Critical XID errors seen since the agent started, per device: sticky,
    /// like the driver's own view, until an admin clears the GPU on the server.
    xids: Arc<Mutex<BTreeMap<u32, String>>>,
}

/// Watches NVML's critical XID events on a thread of its own (NVML's event
/// set is not `Send`), recording them per device index.
fn watch_xids(count: u32, xids: Arc<Mutex<BTreeMap<u32, String>>>) {
    let spawned = std::thread::Builder::new()
        .name("nvml-xid".into())
        .spawn(move || {
            let Ok(nvml) = Nvml::init() else { return };
            let Ok(mut set) = nvml.create_event_set() else {
                return;
            };
            for i in 0..count {
                let Ok(d) = nvml.device_by_index(i) else {
                    continue;
                };
                set = match d.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                    Ok(s) => s,
                    Err(e) => {
                        // The set is consumed by a failed registration.
                        tracing::warn!("NVML: no XID events for GPU {i}: {}", e.error);
                        return;
                    }
                };
            }
            loop {
                match set.wait(5_000) {
                    Ok(ev) => {
                        let index = ev.device.index().unwrap_or(u32::MAX);
                        let what = match ev.event_data {
                            Some(XidError::Value(x)) => format!("critical XID {x}"),
                            _ => "critical XID error".to_string(),
                        };
                        tracing::error!("GPU {index}: {what}");
                        if let Ok(mut m) = xids.lock() {
                            m.insert(index, what);
                        }
                    }
                    Err(nvml_wrapper::error::NvmlError::Timeout) => {}
                    Err(e) => {
                        tracing::warn!("NVML event wait: {e}; XID watch stops");
                        return;
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the XID watch: {e}");
    }
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
            healthy: true,
            island: if nvlink_all { 0 } else { index },
        })
        .collect()
}

fn from_nvml(nvml: &Nvml) -> Result<Vec<Gpu>, nvml_wrapper::error::NvmlError> {
    let mut out = Vec::new();
    let mut linked = Vec::new();
    for i in 0..nvml.device_count()? {
        let d = nvml.device_by_index(i)?;
        let name = d.name()?;
        // "NVIDIA H100 80GB HBM3" → "H100": the model users ask for.
        let model = name
            .split_whitespace()
            .find(|w| {
                w.chars().any(|c| c.is_ascii_digit()) && w.chars().any(|c| c.is_ascii_alphabetic())
            })
            .unwrap_or(&name)
            .to_string();
        let memory_gib = (d.memory_info()?.total / (1 << 30)) as u32;
        let has_nvlink = (0..18).any(|l| d.link_wrapper_for(l).is_active().unwrap_or(false));
        linked.push(has_nvlink);
        out.push(Gpu {
            index: i,
            model,
            memory_gib,
            healthy: true,
            island: 0,
        });
    }
    // GPUs with active NVLink share the node's NVSwitch island; the others
    // talk over PCIe and each form their own.
    for (g, l) in out.iter_mut().zip(linked) {
        if !l {
            g.island = 1 + g.index;
        }
    }
    Ok(out)
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
            source: "declared",
            nvml: None,
            xids: Arc::default(),
        }),
        Inventory::Nvml => {
            let nvml = Nvml::init().map_err(|e| DiscoveryError::Nvml(e.to_string()))?;
            let gpus = from_nvml(&nvml).map_err(|e| DiscoveryError::Nvml(e.to_string()))?;
            let xids = Arc::default();
            watch_xids(gpus.len() as u32, Arc::clone(&xids));
            Ok(Discovery {
                gpus,
                source: "nvml",
                nvml: Some(nvml),
                xids,
            })
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
    /// Every GPU's health now: NVML's uncorrected ECC errors or a device that
    /// stopped answering, and the health file.
    pub fn health(&self, state_dir: &Path) -> Vec<GpuHealth> {
        let marked = read_health_file(&state_dir.join("unhealthy-gpus"));
        self.gpus
            .iter()
            .map(|g| {
                let mut reason = marked.get(&g.index).cloned();
                if reason.is_none() {
                    reason = self.xids.lock().ok().and_then(|m| m.get(&g.index).cloned());
                }
                if let (None, Some(nvml)) = (&reason, &self.nvml) {
                    reason = match nvml.device_by_index(g.index) {
                        Err(e) => Some(format!("NVML cannot reach the device: {e}")),
                        Ok(d) => match d
                            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
                        {
                            Ok(n) if n > 0 => Some(format!("{n} uncorrected ECC errors")),
                            _ => None,
                        },
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
