//! The agent protocol: what a node agent reports on each sync and the
//! assignments (desired state) the server answers with, kubelet-style.

use crate::job::{JobId, RunSpec};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Health of one GPU as the agent sees it (NVML or its declared inventory).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuHealth {
    /// Device index.
    pub index: u32,
    /// Whether it may be assigned.
    pub healthy: bool,
    /// Why not (an XID error, an ECC count, an operator's mark).
    #[serde(default)]
    pub reason: Option<String>,
}

/// What the ranks of one job attempt on this node are doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum TaskState {
    /// Every rank of the attempt on this node has started.
    Running,
    /// A rank's main process exited non-zero (the code) while processes of
    /// the attempt still run here: the gang must be stopped, but its GPUs
    /// are not free yet.
    Failing {
        /// Exit code; 128+N for a rank killed by signal N.
        exit_code: i32,
    },
    /// No process of the attempt is left on this node: the first non-zero
    /// exit code of its ranks, or 0 when all exited 0.
    Exited {
        /// Exit code; 128+N for a rank killed by signal N.
        exit_code: i32,
    },
}

/// One job attempt's status on the reporting node (serde's `flatten` rules
/// out `deny_unknown_fields` here).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskReport {
    /// Job.
    pub job: JobId,
    /// Which attempt (restarts and requeues start a new one).
    pub attempt: u32,
    /// What its ranks here do.
    #[serde(flatten)]
    pub state: TaskState,
}

/// The body of `POST /v1/agent/{node}/sync`: heartbeat, GPU health and task states.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyncRequest {
    /// Every GPU's health.
    pub gpus: Vec<GpuHealth>,
    /// Every job attempt the agent knows of.
    pub tasks: Vec<TaskReport>,
}

/// One rank to run on this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankAssignment {
    /// Global rank (`RANK`).
    pub rank: u32,
    /// Rank among this job's ranks on this node (`LOCAL_RANK`).
    pub local_rank: u32,
    /// Device indices on this node (`CUDA_VISIBLE_DEVICES`).
    pub gpus: Vec<u32>,
}

/// One job attempt the node should run (or, with `stop`, checkpoint and stop).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Assignment {
    /// Job.
    pub job: JobId,
    /// Attempt; ranks of any other attempt of this job must not run.
    pub attempt: u32,
    /// Job name (for people).
    pub name: String,
    /// Owner.
    pub user: String,
    /// What to run.
    pub run: RunSpec,
    /// This node's ranks.
    pub ranks: Vec<RankAssignment>,
    /// Ranks in the whole gang (`WORLD_SIZE`).
    pub world_size: u32,
    /// Index of this node among the gang's nodes (`NODE_RANK`).
    pub node_rank: u32,
    /// Nodes in the gang (`NNODES`).
    pub nnodes: u32,
    /// Address of rank 0's node (`MASTER_ADDR`).
    pub master_addr: String,
    /// Rendezvous port on it (`MASTER_PORT`).
    pub master_port: u16,
    /// CPU per rank in thousandths of a core (a limit for containers).
    pub cpu_millis: u64,
    /// Memory per rank in MiB (a limit for containers).
    pub memory_mib: u64,
    /// Signal that asks a rank to checkpoint (POSIX number).
    pub checkpoint_signal: i32,
    /// Seconds between that signal and the kill.
    pub grace_seconds: u64,
    /// Checkpoint now and stop: the job is being preempted.
    pub stop: bool,
}

/// The answer to a sync: the whole desired state of the node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyncResponse {
    /// Everything that should run here; anything else must not.
    pub assignments: Vec<Assignment>,
}

/// A page of a rank's log, as the agent serves it and the server relays it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogChunk {
    /// Text (invalid UTF-8 replaced).
    pub data: String,
    /// Byte offset to ask for next.
    pub next_offset: u64,
}

/// The torchrun-style environment of one rank, without the node-local
/// `GANGWAY_CHECKPOINT_DIR` and device variables the agent adds.
pub fn rank_env(a: &Assignment, r: &RankAssignment) -> BTreeMap<String, String> {
    let mut env = a.run.env.clone();
    let local_world = a.ranks.len();
    for (k, v) in [
        ("MASTER_ADDR", a.master_addr.clone()),
        ("MASTER_PORT", a.master_port.to_string()),
        ("WORLD_SIZE", a.world_size.to_string()),
        ("RANK", r.rank.to_string()),
        ("LOCAL_RANK", r.local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", local_world.to_string()),
        ("NODE_RANK", a.node_rank.to_string()),
        ("GROUP_RANK", a.node_rank.to_string()),
        ("NNODES", a.nnodes.to_string()),
        ("GANGWAY_JOB_ID", a.job.to_string()),
        ("GANGWAY_JOB_NAME", a.name.clone()),
        ("GANGWAY_ATTEMPT", a.attempt.to_string()),
    ] {
        env.insert(k.to_string(), v);
    }
    env
}

/// The rendezvous port of a job attempt: fixed per job so every rank agrees
/// without talking, varied by attempt so a restart does not meet the
/// previous attempt's lingering sockets.
pub fn master_port(job: JobId, attempt: u32) -> u16 {
    let spread = (job.0.wrapping_mul(7).wrapping_add(u64::from(attempt))) % 20_000;
    20_000 + spread as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_bodies_round_trip_with_flattened_states() {
        let r = SyncRequest {
            gpus: vec![GpuHealth {
                index: 0,
                healthy: false,
                reason: Some("XID 79".into()),
            }],
            tasks: vec![TaskReport {
                job: JobId(4),
                attempt: 1,
                state: TaskState::Exited { exit_code: 137 },
            }],
        };
        let text = serde_json::to_string(&r).expect("encode");
        assert!(
            text.contains(r#""state":"exited","exit_code":137"#),
            "{text}"
        );
        assert_eq!(
            serde_json::from_str::<SyncRequest>(&text).expect("decode"),
            r
        );
    }

    #[test]
    fn gangway_variables_override_user_environment() {
        let mut run = RunSpec::default();
        run.env.insert("RANK".into(), "99".into());
        run.env.insert("DATA".into(), "/data".into());
        let a = Assignment {
            job: JobId(7),
            attempt: 2,
            name: "train".into(),
            user: "alice".into(),
            run,
            ranks: vec![
                RankAssignment {
                    rank: 4,
                    local_rank: 0,
                    gpus: vec![0, 1],
                },
                RankAssignment {
                    rank: 5,
                    local_rank: 1,
                    gpus: vec![2, 3],
                },
            ],
            world_size: 8,
            node_rank: 1,
            nnodes: 2,
            master_addr: "10.0.0.1".into(),
            master_port: master_port(JobId(7), 2),
            cpu_millis: 0,
            memory_mib: 0,
            checkpoint_signal: 15,
            grace_seconds: 30,
            stop: false,
        };
        let env = rank_env(&a, &a.ranks[1]);
        assert_eq!(env["RANK"], "5");
        assert_eq!(env["LOCAL_RANK"], "1");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(env["WORLD_SIZE"], "8");
        assert_eq!(env["NODE_RANK"], "1");
        assert_eq!(env["DATA"], "/data");
        assert_eq!(env["MASTER_ADDR"], "10.0.0.1");
        assert_ne!(master_port(JobId(7), 2), master_port(JobId(7), 3));
    }
}
