//! The recorded-machine path and the declared path agree wherever the
//! declared path can express the machine: one model and memory size, all
//! GPUs on one NVLink switch or none, no NUMA, no NICs, bus ids in index
//! order. Same GPUs as the scheduler sees them, same health from the health
//! file, same devices handed to a rank.

use gangway_agent::binding::bind;
use gangway_agent::discovery::discover;
use gangway_agent::Inventory;
use proptest::prelude::*;
use std::collections::BTreeSet;

fn machine_yaml(gpus: u32, model: &str, gib: u32, nvlink_all: bool) -> String {
    let mut s = String::from("gpus:\n");
    for i in 0..gpus {
        s += &format!(
            "  - {{ name: {model:?}, uuid: GPU-p-{i}, pci_bus_id: \"00000000:{:02X}:00.0\", memory_bytes: {}, nvlink_peers: [{}] }}\n",
            i + 1,
            u64::from(gib) << 30,
            if nvlink_all { "nvswitch0" } else { "" }
        );
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn recorded_and_declared_agree(
        gpus in 1u32..=16,
        model in prop::sample::select(vec!["H100", "NVIDIA A100-SXM4-80GB", "NVIDIA L4"]),
        gib in 1u32..=200,
        nvlink_all in any::<bool>(),
        marked in prop::collection::btree_set(0u32..16, 0..4),
        assigned in prop::collection::btree_set(0u32..16, 0..8),
    ) {
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("m.yaml");
        std::fs::write(&file, machine_yaml(gpus, model, gib, nvlink_all)).expect("write");
        let health: String = marked.iter().map(|i| format!("{i} checked by hand\n")).collect();
        std::fs::write(dir.path().join("unhealthy-gpus"), health).expect("write");

        let rec = discover(&Inventory::Machine(file)).expect("recorded");
        let dec = discover(&Inventory::Declared {
            gpus,
            model: model.to_string(),
            memory_gib: gib,
            nvlink_all,
        })
        .expect("declared");
        prop_assert_eq!(rec.gpus.len(), dec.gpus.len());
        for (r, d) in rec.gpus.iter().zip(&dec.gpus) {
            prop_assert_eq!(r.index, d.index);
            prop_assert_eq!(&r.model, &d.model);
            prop_assert_eq!(r.memory_gib, d.memory_gib);
            prop_assert_eq!(r.memory_mib(), d.memory_mib());
            prop_assert_eq!(r.healthy, d.healthy);
            prop_assert_eq!(r.island, d.island);
            prop_assert_eq!(r.mig, d.mig);
            prop_assert_eq!(r.assignable(), d.assignable());
        }
        prop_assert_eq!(rec.health(dir.path()), dec.health(dir.path()));

        // A rank on the same GPUs sees the same devices, in the same order.
        let mine: Vec<u32> = assigned.into_iter().filter(|i| *i < gpus).collect();
        let br = bind(&rec.gpus, &rec.topology, &mine, 1000, &[0]);
        let bd = bind(&dec.gpus, &dec.topology, &mine, 1000, &[0]);
        prop_assert_eq!(br.env.get("CUDA_DEVICE_ORDER"), bd.env.get("CUDA_DEVICE_ORDER"));
        let by_uuid: Vec<String> = br
            .env
            .get("CUDA_VISIBLE_DEVICES")
            .map(|v| {
                v.split(',')
                    .filter(|s| !s.is_empty())
                    .map(|u| u.trim_start_matches("GPU-p-").to_string())
                    .collect()
            })
            .unwrap_or_default();
        let by_index: Vec<String> = bd
            .env
            .get("CUDA_VISIBLE_DEVICES")
            .map(|v| v.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect())
            .unwrap_or_default();
        prop_assert_eq!(by_uuid, by_index);
        prop_assert_eq!(br.cpus, bd.cpus);
        prop_assert_eq!(br.env_defaults, bd.env_defaults);
        let islands: BTreeSet<u32> = rec.gpus.iter().map(|g| g.island).collect();
        prop_assert_eq!(islands.len(), if nvlink_all { 1 } else { gpus as usize });
    }
}
