//! A recorded machine: a GPU server described in YAML (docs/GPU.md), read
//! through the same [`GpuSource`] trait as NVML, with NVML events scripted
//! over time (XIDs, a GPU falling off the bus, ECC errors, failed row
//! remapping). `gangway agent --machine FILE` and `gangway up --machine
//! FILE` run on one; the shipped ones are under `examples/machines/`.

use crate::gpu_source::{
    parse_cpu_list, DeviceFacts, DeviceState, EventWatch, GpuEvent, GpuSource, Nic, SourceError,
};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Largest machine file read.
const MAX_BYTES: u64 = 1 << 20;
/// Most GPUs a machine may have (the scheduler's per-node limit).
const MAX_GPUS: usize = 64;

/// Why a machine file was refused.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// Unreadable.
    #[error("{path}: {error}")]
    Read {
        /// The file.
        path: String,
        /// What went wrong.
        error: std::io::Error,
    },
    /// Not a machine description.
    #[error("{path}: {problem}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong, naming the field.
        problem: String,
    },
}

/// The file's shape (docs/GPU.md).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineSpec {
    /// What it is, e.g. `DGX H100`.
    #[serde(default)]
    pub description: String,
    /// NUMA nodes with their CPUs (`cpus: "0-55,112-167"`).
    #[serde(default)]
    pub numa_nodes: Vec<NumaSpec>,
    /// GPUs in NVML index order.
    pub gpus: Vec<GpuSpec>,
    /// Network adapters (InfiniBand/RoCE HCAs).
    #[serde(default)]
    pub nics: Vec<Nic>,
    /// NVML events over time.
    #[serde(default)]
    pub events: Vec<EventSpec>,
}

/// One NUMA node.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaSpec {
    /// Node id.
    pub id: u32,
    /// CPU list as the kernel writes it (`0-55,112-167`).
    pub cpus: String,
}

/// One GPU as NVML would describe it.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    /// NVML name.
    pub name: String,
    /// UUID.
    pub uuid: String,
    /// PCI bus id (`00000000:18:00.0`).
    pub pci_bus_id: String,
    /// Where the GPU sits in the PCI tree (a sysfs device path); NICs
    /// sharing the longest part of it are the nearest.
    #[serde(default)]
    pub pci_path: Option<String>,
    /// Total memory in bytes (`nvmlDeviceGetMemoryInfo`).
    pub memory_bytes: u64,
    /// NUMA node.
    #[serde(default)]
    pub numa_node: Option<u32>,
    /// Remote end of each active NVLink: another GPU's PCI bus id, or a
    /// switch's (`nvswitch0`); GPUs that reach each other, directly or
    /// through a shared switch, form one island.
    #[serde(default)]
    pub nvlink_peers: Vec<String>,
    /// MIG mode and instances.
    #[serde(default)]
    pub mig: Option<MigSpec>,
    /// Volatile uncorrected ECC errors at start.
    #[serde(default)]
    pub ecc_uncorrected: u64,
    /// Row remapping failed at start.
    #[serde(default)]
    pub remap_failed: bool,
    /// Row remapping pending at start.
    #[serde(default)]
    pub remap_pending: bool,
    /// Registering for its events fails (a driver that refuses the event set).
    #[serde(default)]
    pub watch_fails: bool,
}

/// MIG state of one GPU.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigSpec {
    /// MIG mode enabled.
    pub enabled: bool,
    /// Instance profiles (`1g.10gb`).
    #[serde(default)]
    pub instances: Vec<String>,
}

/// Something NVML reports at a time after the agent starts.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventSpec {
    /// Seconds after the agent starts.
    pub at_seconds: f64,
    /// Which GPU (NVML index).
    pub gpu: u32,
    /// A critical XID event.
    #[serde(default)]
    pub xid: Option<u64>,
    /// The GPU falls off the bus (NVML answers `GPU_IS_LOST` from then on).
    #[serde(default)]
    pub lost: bool,
    /// Uncorrected ECC errors added.
    #[serde(default)]
    pub ecc_uncorrected: u64,
    /// Row remapping fails.
    #[serde(default)]
    pub remap_failed: bool,
}

/// A recorded machine behind [`GpuSource`].
pub struct RecordedMachine {
    path: String,
    spec: MachineSpec,
    start: Instant,
    /// Events applied so far, per GPU (their effects on `state`).
    applied: Mutex<Vec<DeviceState>>,
}

impl MachineSpec {
    fn check(&self) -> Result<(), String> {
        if self.gpus.is_empty() {
            return Err("gpus: a machine needs at least one GPU".into());
        }
        if self.gpus.len() > MAX_GPUS {
            return Err(format!(
                "gpus: {} GPUs; at most {MAX_GPUS}",
                self.gpus.len()
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, g) in self.gpus.iter().enumerate() {
            if g.name.trim().is_empty() {
                return Err(format!("gpus[{i}].name: must not be empty"));
            }
            if g.memory_bytes == 0 {
                return Err(format!("gpus[{i}].memory_bytes: must be positive"));
            }
            if !seen.insert(g.pci_bus_id.to_ascii_lowercase()) {
                return Err(format!(
                    "gpus[{i}].pci_bus_id: {} appears twice",
                    g.pci_bus_id
                ));
            }
            if let Some(n) = g.numa_node {
                if !self.numa_nodes.is_empty() && !self.numa_nodes.iter().any(|x| x.id == n) {
                    return Err(format!("gpus[{i}].numa_node: no NUMA node {n}"));
                }
            }
        }
        for (i, n) in self.numa_nodes.iter().enumerate() {
            parse_cpu_list(&n.cpus).map_err(|e| format!("numa_nodes[{i}].cpus: {e}"))?;
        }
        for (i, e) in self.events.iter().enumerate() {
            if !e.at_seconds.is_finite() || e.at_seconds < 0.0 || e.at_seconds > 1e9 {
                return Err(format!("events[{i}].at_seconds: must be 0 or more"));
            }
            if e.gpu as usize >= self.gpus.len() {
                return Err(format!("events[{i}].gpu: no GPU {}", e.gpu));
            }
            if e.xid.is_none() && !e.lost && e.ecc_uncorrected == 0 && !e.remap_failed {
                return Err(format!(
                    "events[{i}]: say what happens (xid, lost, ecc_uncorrected or remap_failed)"
                ));
            }
        }
        Ok(())
    }
}

impl RecordedMachine {
    /// Reads and checks a machine file; its events count from now.
    pub fn load(path: &Path) -> Result<Self, MachineError> {
        let p = path.display().to_string();
        let read = |error| MachineError::Read {
            path: p.clone(),
            error,
        };
        let len = std::fs::metadata(path).map_err(read)?.len();
        if len > MAX_BYTES {
            return Err(MachineError::Invalid {
                path: p,
                problem: format!("{len} bytes; at most {MAX_BYTES}"),
            });
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        Self::parse(&p, &text)
    }

    /// Parses a machine description (`path` names it in errors).
    pub fn parse(path: &str, text: &str) -> Result<Self, MachineError> {
        let invalid = |problem: String| MachineError::Invalid {
            path: path.to_string(),
            problem,
        };
        let spec: MachineSpec = serde_saphyr::from_str(text)
            .map_err(|e| invalid(e.to_string().lines().next().unwrap_or("").to_string()))?;
        spec.check().map_err(invalid)?;
        let applied = spec
            .gpus
            .iter()
            .map(|g| DeviceState {
                ecc_uncorrected: g.ecc_uncorrected,
                remap_failed: g.remap_failed,
                remap_pending: g.remap_pending,
            })
            .collect();
        Ok(RecordedMachine {
            path: path.to_string(),
            spec,
            start: Instant::now(),
            applied: Mutex::new(applied),
        })
    }

    /// The description as read.
    pub fn spec(&self) -> &MachineSpec {
        &self.spec
    }

    fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Whether GPU `index` has fallen off the bus by now.
    fn lost(&self, index: u32) -> bool {
        let now = self.elapsed();
        self.spec
            .events
            .iter()
            .any(|e| e.gpu == index && e.lost && e.at_seconds <= now)
    }

    fn gpu(&self, index: u32) -> Result<&GpuSpec, SourceError> {
        if self.lost(index) {
            return Err(SourceError::Lost(format!(
                "GPU {index} has fallen off the bus"
            )));
        }
        self.spec
            .gpus
            .get(index as usize)
            .ok_or_else(|| SourceError::Other(format!("no GPU {index}")))
    }
}

struct ScriptedWatch<'a> {
    machine: &'a RecordedMachine,
    index: u32,
    /// Events of this GPU not yet delivered, in time order.
    pending: Vec<(f64, Option<u64>, bool)>,
}

impl EventWatch for ScriptedWatch<'_> {
    fn wait(&mut self, timeout: Duration) -> Result<Option<GpuEvent>, SourceError> {
        let Some(&(at, xid, lost)) = self.pending.first() else {
            std::thread::sleep(timeout);
            return Ok(None);
        };
        let now = self.machine.elapsed();
        if at > now {
            let left = Duration::from_secs_f64(at - now);
            if left > timeout {
                std::thread::sleep(timeout);
                return Ok(None);
            }
            std::thread::sleep(left);
        }
        self.pending.remove(0);
        if lost {
            return Err(SourceError::Lost(format!(
                "GPU {} has fallen off the bus",
                self.index
            )));
        }
        Ok(Some(GpuEvent::Xid(xid)))
    }
}

impl GpuSource for RecordedMachine {
    fn describe(&self) -> String {
        format!("machine {}", self.path)
    }

    fn device_count(&self) -> Result<u32, SourceError> {
        Ok(self.spec.gpus.len() as u32)
    }

    fn device(&self, index: u32) -> Result<DeviceFacts, SourceError> {
        let g = self.gpu(index)?;
        let mig = g.mig.as_ref().filter(|m| m.enabled);
        Ok(DeviceFacts {
            name: g.name.clone(),
            uuid: g.uuid.clone(),
            pci_bus_id: g.pci_bus_id.clone(),
            memory_bytes: g.memory_bytes,
            numa_node: g.numa_node,
            nvlink_peers: g.nvlink_peers.clone(),
            mig_enabled: mig.is_some(),
            mig_instances: mig.map(|m| m.instances.clone()).unwrap_or_default(),
        })
    }

    fn state(&self, index: u32) -> Result<DeviceState, SourceError> {
        self.gpu(index)?;
        let now = self.elapsed();
        let mut s = self
            .applied
            .lock()
            .map_err(|_| SourceError::Other("state lock poisoned".into()))?
            .get(index as usize)
            .cloned()
            .unwrap_or_default();
        for e in self
            .spec
            .events
            .iter()
            .filter(|e| e.gpu == index && e.at_seconds <= now)
        {
            s.ecc_uncorrected = s.ecc_uncorrected.saturating_add(e.ecc_uncorrected);
            s.remap_failed |= e.remap_failed;
        }
        Ok(s)
    }

    fn watch(&self, index: u32) -> Result<Box<dyn EventWatch + '_>, SourceError> {
        let g = self.gpu(index)?;
        if g.watch_fails {
            return Err(SourceError::NotSupported(format!(
                "GPU {index} refuses event registration"
            )));
        }
        let mut pending: Vec<(f64, Option<u64>, bool)> = self
            .spec
            .events
            .iter()
            .filter(|e| e.gpu == index && (e.xid.is_some() || e.lost))
            .map(|e| (e.at_seconds, e.xid, e.lost))
            .collect();
        pending.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(Box::new(ScriptedWatch {
            machine: self,
            index,
            pending,
        }))
    }

    fn numa_cpus(&self) -> BTreeMap<u32, Vec<u32>> {
        self.spec
            .numa_nodes
            .iter()
            .map(|n| (n.id, parse_cpu_list(&n.cpus).unwrap_or_default()))
            .collect()
    }

    fn nics(&self) -> Vec<Nic> {
        self.spec.nics.clone()
    }

    fn pci_path(&self, index: u32) -> Option<String> {
        self.spec.gpus.get(index as usize)?.pci_path.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Inventory;
    use crate::discovery::discover;
    use std::path::PathBuf;

    fn shipped(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/machines")
            .join(name)
    }

    fn with_events(base: &str, events: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tmp");
        let text = std::fs::read_to_string(shipped(base)).expect("machine");
        let p = dir.path().join(base);
        std::fs::write(&p, format!("{text}events:\n{events}")).expect("write");
        (dir, p)
    }

    #[test]
    fn every_shipped_machine_reads_as_nvml_would_answer() {
        // (file, GPUs, NVML name, MiB, islands by GPU, MIG)
        type Case<'a> = (&'a str, usize, &'a str, u64, &'a [u32], bool);
        let cases: [Case; 5] = [
            (
                "dgx-h100.yaml",
                8,
                "NVIDIA H100 80GB HBM3",
                81_559,
                &[0; 8],
                false,
            ),
            (
                "hgx-a100-80gb.yaml",
                8,
                "NVIDIA A100-SXM4-80GB",
                81_920,
                &[0; 8],
                false,
            ),
            (
                "a100-pcie-nvlink-pairs.yaml",
                4,
                "NVIDIA A100 80GB PCIe",
                81_920,
                &[0, 0, 2, 2],
                false,
            ),
            (
                "l4x8-pcie.yaml",
                8,
                "NVIDIA L4",
                23_034,
                &[0, 1, 2, 3, 4, 5, 6, 7],
                false,
            ),
            (
                "a100-mig.yaml",
                8,
                "NVIDIA A100-SXM4-40GB",
                40_960,
                &[0; 8],
                true,
            ),
        ];
        for (file, n, name, mib, islands, mig) in cases {
            let d = discover(&Inventory::Machine(shipped(file))).expect(file);
            assert_eq!(d.gpus.len(), n, "{file}");
            for (i, g) in d.gpus.iter().enumerate() {
                assert_eq!(g.model, name, "{file}");
                assert_eq!(g.memory_mib, Some(mib), "{file}");
                assert_eq!(g.memory_mib(), mib, "{file}");
                assert_eq!(g.island, islands[i], "{file} GPU {i}");
                assert_eq!(g.mig, mig, "{file}");
                assert!(g.uuid.as_deref().is_some_and(|u| u.starts_with("GPU-")));
                assert!(g.numa_node.is_some(), "{file}");
            }
            assert!(d
                .health(Path::new("/nonexistent"))
                .iter()
                .all(|h| h.healthy));
            assert!(d.source.starts_with("machine "), "{}", d.source);
        }
        let d = discover(&Inventory::Machine(shipped("dgx-h100.yaml"))).expect("dgx");
        assert_eq!(d.topology.numa_cpus.len(), 2);
        assert_eq!(d.topology.numa_cpus[&0].len(), 112);
        assert_eq!(d.topology.nics.len(), 8);
        assert_eq!(d.gpus[4].numa_node, Some(1));
        let mig = discover(&Inventory::Machine(shipped("a100-mig.yaml"))).expect("mig");
        assert_eq!(mig.topology.mig_instances[1], vec!["3g.20gb", "4g.20gb"]);
    }

    /// Waits until `f` holds (the watches run on their own threads).
    fn eventually(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn scripted_events_mark_only_their_gpu_and_application_xids_none() {
        let (dir, p) = with_events(
            "dgx-h100.yaml",
            "  - { at_seconds: 0.2, gpu: 0, xid: 13 }
  - { at_seconds: 0.2, gpu: 0, xid: 31 }
  - { at_seconds: 0.2, gpu: 0, xid: 43 }
  - { at_seconds: 0.2, gpu: 0, xid: 45 }
  - { at_seconds: 0.2, gpu: 0, xid: 68 }
  - { at_seconds: 0.2, gpu: 1, xid: 79 }
  - { at_seconds: 0.2, gpu: 2, lost: true }
  - { at_seconds: 0.2, gpu: 3, ecc_uncorrected: 1 }
  - { at_seconds: 0.2, gpu: 4, remap_failed: true }
  - { at_seconds: 0.4, gpu: 6, xid: 94 }
",
        );
        let text = std::fs::read_to_string(&p).expect("read").replacen(
            "uuid: GPU-h100-0000-4000-8000-000000000005\n",
            "uuid: GPU-h100-0000-4000-8000-000000000005\n    watch_fails: true\n",
            1,
        );
        std::fs::write(&p, text).expect("write");
        let d = discover(&Inventory::Machine(p)).expect("machine");
        let state = dir.path();
        eventually("every scripted fault", || {
            d.health(state).iter().filter(|h| !h.healthy).count() == 5
        });
        let h = d.health(state);
        let reason = |i: usize| h[i].reason.clone().unwrap_or_default();
        assert!(h[0].healthy, "application XIDs: {:?}", h[0].reason);
        assert_eq!(d.application_xids().get(&0), Some(&68));
        assert_eq!(reason(1), "XID 79: GPU has fallen off the bus");
        assert!(reason(2).starts_with("GPU lost"), "{}", reason(2));
        assert_eq!(reason(3), "1 uncorrected ECC errors");
        assert!(
            reason(4).starts_with("row remapping failed"),
            "{}",
            reason(4)
        );
        // GPU 5's watch failed; GPU 6's XID still arrived.
        assert!(h[5].healthy);
        assert!(d.watch_errors().contains_key(&5), "{:?}", d.watch_errors());
        assert_eq!(reason(6), "XID 94: contained ECC error");
        assert!(h[7].healthy);
        // Sticky: the verdicts stay until an admin clears the GPU.
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(d.health(state).iter().filter(|h| !h.healthy).count(), 5);
    }

    #[test]
    fn a_pending_row_remap_and_a_gpu_lost_at_start_are_reported() {
        let text = std::fs::read_to_string(shipped("l4x8-pcie.yaml"))
            .expect("read")
            .replacen(
                "numa_node: 0\n",
                "numa_node: 0\n    remap_pending: true\n",
                1,
            );
        let m = RecordedMachine::parse("pending.yaml", &text).expect("parse");
        assert!(m.state(0).expect("state").remap_pending);
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("m.yaml");
        std::fs::write(&p, &text).expect("write");
        let d = discover(&Inventory::Machine(p)).expect("machine");
        let h = d.health(dir.path());
        assert_eq!(
            h[0].reason.as_deref(),
            Some("row remapping pending: the GPU needs a reset")
        );
        assert!(h[1].healthy);
        // A GPU already gone when the agent starts: discovery says which.
        let (_d, p) = with_events(
            "l4x8-pcie.yaml",
            "  - { at_seconds: 0, gpu: 3, lost: true }\n",
        );
        let e = discover(&Inventory::Machine(p)).expect_err("lost at start");
        assert!(e.to_string().contains("GPU 3: GPU lost"), "{e}");
    }

    #[test]
    fn bad_machine_files_are_refused_naming_the_field() {
        for (text, want) in [
            ("gpus: []\n", "gpus: a machine needs at least one GPU"),
            ("gpus:\n  - { name: x, uuid: u, pci_bus_id: a, memory_bytes: 0 }\n", "gpus[0].memory_bytes"),
            ("gpus:\n  - { name: x, uuid: u, pci_bus_id: a, memory_bytes: 1 }\n  - { name: x, uuid: v, pci_bus_id: A, memory_bytes: 1 }\n", "gpus[1].pci_bus_id"),
            ("numa_nodes: [{ id: 0, cpus: \"3-1\" }]\ngpus:\n  - { name: x, uuid: u, pci_bus_id: a, memory_bytes: 1 }\n", "numa_nodes[0].cpus"),
            ("gpus:\n  - { name: x, uuid: u, pci_bus_id: a, memory_bytes: 1, numa_node: 4 }\nnuma_nodes: [{ id: 0, cpus: \"0\" }]\n", "gpus[0].numa_node"),
            ("gpus:\n  - { name: x, uuid: u, pci_bus_id: a, memory_bytes: 1 }\nevents: [{ at_seconds: 1, gpu: 9, xid: 79 }]\n", "events[0].gpu"),
            ("gpus:\n  - { name: x, uuid: u, pci_bus_id: a, memory_bytes: 1 }\nevents: [{ at_seconds: -1, gpu: 0, xid: 79 }]\n", "events[0].at_seconds"),
            ("gpus:\n  - { name: x, uuid: u, pci_bus_id: a, memory_bytes: 1 }\nevents: [{ at_seconds: 1, gpu: 0 }]\n", "events[0]: say what happens"),
            ("gpus:\n  - { name: x, uuid: u, pci_bus_id: a, memory_bytes: 1, colour: red }\n", "colour"),
        ] {
            let e = RecordedMachine::parse("m.yaml", text)
                .err()
                .unwrap_or_else(|| panic!("accepted {text}"));
            assert!(e.to_string().contains(want), "{want:?} in {e}");
        }
        let many: String = (0..65)
            .map(|i| format!("  - {{ name: x, uuid: u{i}, pci_bus_id: b{i}, memory_bytes: 1 }}\n"))
            .collect();
        let e = RecordedMachine::parse("m.yaml", &format!("gpus:\n{many}")).err();
        assert!(e.is_some_and(|e| e.to_string().contains("at most 64")));
    }
}
