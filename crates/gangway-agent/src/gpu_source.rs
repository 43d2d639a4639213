//! Where the agent learns about its GPUs: a small trait over what it asks
//! NVML, with the real library ([`NvmlSource`], loaded at run time, so
//! neither building nor running the agent needs a driver) and a recorded
//! machine ([`crate::machine::RecordedMachine`]) behind it. Discovery,
//! health and topology read either one the same way.

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use std::collections::BTreeMap;
use std::time::Duration;

/// What a source could not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// The device stopped answering (NVML's `GPU_IS_LOST`: fallen off the bus).
    #[error("GPU lost: {0}")]
    Lost(String),
    /// The source does not know this (an old driver, a feature the GPU lacks).
    #[error("not supported: {0}")]
    NotSupported(String),
    /// Anything else.
    #[error("{0}")]
    Other(String),
}

impl From<NvmlError> for SourceError {
    fn from(e: NvmlError) -> Self {
        match e {
            NvmlError::GpuLost => SourceError::Lost(e.to_string()),
            NvmlError::NotSupported => SourceError::NotSupported(e.to_string()),
            e => SourceError::Other(e.to_string()),
        }
    }
}

/// A GPU's fixed facts, as NVML names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFacts {
    /// `nvmlDeviceGetName`, e.g. `NVIDIA A100-SXM4-80GB`.
    pub name: String,
    /// `nvmlDeviceGetUUID`, e.g. `GPU-…`.
    pub uuid: String,
    /// `nvmlDeviceGetPciInfo().busId`, e.g. `00000000:18:00.0`.
    pub pci_bus_id: String,
    /// `nvmlDeviceGetMemoryInfo().total`.
    pub memory_bytes: u64,
    /// `nvmlDeviceGetNumaNodeId`; `None` where the machine has no NUMA.
    pub numa_node: Option<u32>,
    /// PCI bus ids at the far end of each active NVLink (an NVSwitch's own
    /// id for switched systems).
    pub nvlink_peers: Vec<String>,
    /// `nvmlDeviceGetMigMode().current`.
    pub mig_enabled: bool,
    /// MIG instances (profile names, e.g. `1g.10gb`) when MIG is enabled.
    pub mig_instances: Vec<String>,
}

/// A GPU's error counters and repair state, read at each health check.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceState {
    /// Volatile uncorrected ECC errors.
    pub ecc_uncorrected: u64,
    /// A row remapping failed: the memory cannot be repaired.
    pub remap_failed: bool,
    /// A row remapping waits for a GPU reset.
    pub remap_pending: bool,
}

/// An event a device reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuEvent {
    /// A critical XID (`None` when the driver gave no number).
    Xid(Option<u64>),
}

/// A watch on one device's critical events.
pub trait EventWatch {
    /// The next event within `timeout` (`Ok(None)`: none came). An error is
    /// the end of this device's watch (a lost GPU ends it with [`SourceError::Lost`]).
    fn wait(&mut self, timeout: Duration) -> Result<Option<GpuEvent>, SourceError>;
}

/// What the agent asks about its GPUs.
pub trait GpuSource: Send + Sync {
    /// `nvml` or `machine FILE`.
    fn describe(&self) -> String;
    /// Number of GPUs.
    fn device_count(&self) -> Result<u32, SourceError>;
    /// One GPU's facts.
    fn device(&self, index: u32) -> Result<DeviceFacts, SourceError>;
    /// One GPU's error counters now.
    fn state(&self, index: u32) -> Result<DeviceState, SourceError>;
    /// Starts watching one GPU's critical XID events. Called on the watch's
    /// own thread (NVML's event sets cannot move between threads).
    fn watch(&self, index: u32) -> Result<Box<dyn EventWatch + '_>, SourceError>;
    /// CPUs of each NUMA node (the host's, from sysfs).
    fn numa_cpus(&self) -> BTreeMap<u32, Vec<u32>> {
        host_numa_cpus()
    }
    /// The network adapters (the host's InfiniBand/RoCE HCAs, from sysfs).
    fn nics(&self) -> Vec<Nic> {
        host_nics()
    }
    /// GPU `index`'s sysfs device path (the host's, from its PCI bus id).
    fn pci_path(&self, index: u32) -> Option<String> {
        let bus = self.device(index).ok()?.pci_bus_id.to_ascii_lowercase();
        // NVML writes an 8-digit domain, sysfs a 4-digit one.
        let bus = bus
            .strip_prefix("0000")
            .filter(|b| b.len() == 12)
            .unwrap_or(&bus);
        let p = std::fs::canonicalize(format!("/sys/bus/pci/devices/{bus}")).ok()?;
        Some(p.display().to_string())
    }
}

/// A network adapter GPUs talk to other nodes through.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Nic {
    /// The verbs device name NCCL knows (`mlx5_0`).
    pub name: String,
    /// NUMA node.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// sysfs device path (its PCI position).
    #[serde(default)]
    pub pci_path: Option<String>,
}

fn read_trim(p: &std::path::Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Parses a kernel CPU list (`0-3,8,10-11`).
pub fn parse_cpu_list(text: &str) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let a: u32 = a.trim().parse().map_err(|_| format!("bad CPU {a:?}"))?;
        let b: u32 = b.trim().parse().map_err(|_| format!("bad CPU {b:?}"))?;
        if b < a || b - a > 65_535 {
            return Err(format!("bad CPU range {part:?}"));
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// The host's NUMA nodes and their CPUs.
pub fn host_numa_cpus() -> BTreeMap<u32, Vec<u32>> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/node") else {
        return out;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some(cpus) =
            read_trim(&e.path().join("cpulist")).and_then(|t| parse_cpu_list(&t).ok())
        {
            out.insert(id, cpus);
        }
    }
    out
}

/// The host's InfiniBand/RoCE adapters (`/sys/class/infiniband`).
pub fn host_nics() -> Vec<Nic> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/sys/class/infiniband") else {
        return out;
    };
    for e in dir.flatten() {
        let dev = e.path().join("device");
        out.push(Nic {
            name: e.file_name().to_string_lossy().to_string(),
            numa_node: read_trim(&dev.join("numa_node"))
                .and_then(|n| n.parse::<i64>().ok())
                .and_then(|n| u32::try_from(n).ok()),
            pci_path: std::fs::canonicalize(&dev)
                .ok()
                .map(|p| p.display().to_string()),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The real NVML, loaded when the agent starts.
pub struct NvmlSource {
    nvml: Nvml,
}

impl NvmlSource {
    /// Loads `libnvidia-ml.so.1` and initialises it.
    pub fn init() -> Result<Self, SourceError> {
        Ok(NvmlSource {
            nvml: Nvml::init()?,
        })
    }
}

/// Row remapping state through the raw NVML call (the wrapper has none).
fn remapped_rows(d: &nvml_wrapper::Device<'_>, nvml: &Nvml) -> Option<(bool, bool)> {
    let sym = nvml.lib().nvmlDeviceGetRemappedRows.as_ref().ok()?;
    let (mut corr, mut unc, mut pending, mut failed) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: a valid device handle and four out-pointers to live u32s, as
    // nvmlDeviceGetRemappedRows documents.
    let rc = unsafe { sym(d.handle(), &mut corr, &mut unc, &mut pending, &mut failed) };
    (rc == 0).then_some((pending != 0, failed != 0))
}

struct NvmlWatch<'a> {
    set: Option<nvml_wrapper::EventSet<'a>>,
}

impl EventWatch for NvmlWatch<'_> {
    fn wait(&mut self, timeout: Duration) -> Result<Option<GpuEvent>, SourceError> {
        let Some(set) = &self.set else {
            return Err(SourceError::Other("event set closed".into()));
        };
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        match set.wait(ms) {
            Ok(ev) => Ok(Some(GpuEvent::Xid(match ev.event_data {
                Some(XidError::Value(x)) => Some(x),
                _ => None,
            }))),
            Err(NvmlError::Timeout) => Ok(None),
            Err(e) => {
                self.set = None;
                Err(e.into())
            }
        }
    }
}

impl GpuSource for NvmlSource {
    fn describe(&self) -> String {
        "nvml".into()
    }

    fn device_count(&self) -> Result<u32, SourceError> {
        Ok(self.nvml.device_count()?)
    }

    fn device(&self, index: u32) -> Result<DeviceFacts, SourceError> {
        let d = self.nvml.device_by_index(index)?;
        let mut nvlink_peers = Vec::new();
        // NVML_NVLINK_MAX_LINKS is 18 on Hopper; a link NVML does not know ends the walk.
        for l in 0..18 {
            let link = d.link_wrapper_for(l);
            match link.is_active() {
                Ok(true) => {
                    if let Ok(p) = link.remote_pci_info() {
                        nvlink_peers.push(p.bus_id);
                    }
                }
                Ok(false) => {}
                Err(_) => break,
            }
        }
        let mig_enabled = d.mig_mode().is_ok_and(|m| m.current == 1);
        let mut mig_instances = Vec::new();
        if mig_enabled {
            for i in 0..d.mig_device_count().unwrap_or(0) {
                if let Ok(m) = d.mig_device_by_index(i) {
                    // "NVIDIA A100-SXM4-40GB MIG 1g.5gb": the profile is the last word.
                    let name = m.name().unwrap_or_default();
                    mig_instances.push(name.rsplit(' ').next().unwrap_or("").to_string());
                }
            }
        }
        Ok(DeviceFacts {
            name: d.name()?,
            uuid: d.uuid()?,
            pci_bus_id: d.pci_info()?.bus_id,
            memory_bytes: d.memory_info()?.total,
            numa_node: d.numa_node_id().ok(),
            nvlink_peers,
            mig_enabled,
            mig_instances,
        })
    }

    fn state(&self, index: u32) -> Result<DeviceState, SourceError> {
        let d = self.nvml.device_by_index(index)?;
        let ecc_uncorrected =
            match d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile) {
                Ok(n) => n,
                Err(NvmlError::GpuLost) => return Err(SourceError::Lost("GPU is lost".into())),
                Err(_) => 0,
            };
        let (remap_pending, remap_failed) = remapped_rows(&d, &self.nvml).unwrap_or((false, false));
        Ok(DeviceState {
            ecc_uncorrected,
            remap_failed,
            remap_pending,
        })
    }

    fn watch(&self, index: u32) -> Result<Box<dyn EventWatch + '_>, SourceError> {
        let d = self.nvml.device_by_index(index)?;
        let set = self.nvml.create_event_set()?;
        let set = d
            .register_events(EventTypes::CRITICAL_XID_ERROR, set)
            .map_err(|e| SourceError::from(e.error))?;
        Ok(Box::new(NvmlWatch { set: Some(set) }))
    }
}
