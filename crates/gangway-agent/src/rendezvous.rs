//! The node's side of rendezvous ports: the Landlock rulesets that keep
//! process ranks off the cluster's rendezvous range (built off the async
//! loop, kept per range), and naming whoever holds a port rank 0 could
//! not bind (`/proc/net/tcp{,6}` LISTEN sockets → socket inode → the
//! process whose descriptor it is → the rank whose container holds it).

use crate::landlock::PortRules;
use crate::proctrack::{Container, SharedTrack};
use gangway_core::agent::PortRange;
use std::collections::HashMap;
use std::sync::Arc;

/// Most rulesets kept (one per rendezvous range the server sent).
const MAX_RANGES: usize = 4;

/// Most processes looked at when naming a port's holder.
pub const MAX_PROCS: usize = 8192;

/// Most descriptors read when naming a port's holder (all processes).
pub const MAX_FDS: usize = 262_144;

/// How long naming a holder may take before the report goes without it.
const HOLDER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Rank rulesets per rendezvous range.
#[derive(Default)]
pub struct BindRules {
    base: HashMap<PortRange, Arc<PortRules>>,
}

impl BindRules {
    /// The rulesets of one job's ranks here: every rank's (the range
    /// closed) and, when `own` is rank 0's port, rank 0's (the range
    /// closed but that port). Built on a blocking thread. `(None, None)`
    /// where the kernel has no Landlock network rules (the agent says so
    /// when it starts): a held port is then only detected when rank 0
    /// starts.
    pub async fn for_job(
        &mut self,
        range: PortRange,
        own: Option<u16>,
    ) -> (Option<Arc<PortRules>>, Option<Arc<PortRules>>) {
        if crate::landlock::support().is_err() {
            // Said once, when the agent started.
            return (None, None);
        }
        let base = match self.base.get(&range) {
            Some(b) => Some(b.clone()),
            None => {
                let built = build(range, None).await;
                if let Some(b) = &built {
                    if self.base.len() >= MAX_RANGES {
                        self.base.clear();
                    }
                    self.base.insert(range, b.clone());
                }
                built
            }
        };
        let own = match own {
            Some(p) => build(range, Some(p)).await,
            None => base.clone(),
        };
        (base, own)
    }
}

/// Builds one ruleset on a blocking thread; `None` (logged) when it fails.
async fn build(range: PortRange, own: Option<u16>) -> Option<Arc<PortRules>> {
    match tokio::task::spawn_blocking(move || PortRules::build(range, own)).await {
        Ok(Ok(r)) => Some(Arc::new(r)),
        Ok(Err(e)) => {
            tracing::error!(
                "rendezvous ports {}-{}: {e}; ranks start without the port rule",
                range.first,
                range.last
            );
            None
        }
        Err(e) => {
            tracing::error!("building the rendezvous port rules: {e}");
            None
        }
    }
}

/// A LISTEN socket on a port, as `/proc/net/tcp` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listener {
    /// Socket inode (`socket:[N]` in the owner's descriptors).
    pub inode: u64,
    /// The socket's owner.
    pub uid: u32,
}

/// The LISTEN sockets on `port` in the text of `/proc/net/tcp` or
/// `/proc/net/tcp6` (both share the layout: `sl local rem st tx:rx tr:tm
/// retrnsmt uid timeout inode ...`, the local address `HEX:PORT` in hex).
/// Malformed lines are skipped.
pub fn listeners(text: &str, port: u16) -> Vec<Listener> {
    const LISTEN: &str = "0A";
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f.get(1)?.rsplit_once(':')?.1;
            if u16::from_str_radix(local_port, 16).ok()? != port || *f.get(3)? != LISTEN {
                return None;
            }
            Some(Listener {
                uid: f.get(7)?.parse().ok()?,
                inode: f.get(9)?.parse().ok()?,
            })
        })
        .filter(|l| l.inode != 0)
        .collect()
}

/// A process holding a socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// Pid.
    pub pid: i32,
    /// Its command name (`/proc/PID/comm`).
    pub comm: String,
    /// The socket's owner.
    pub uid: u32,
}

/// Who holds a LISTEN socket on `port` in this network namespace: the
/// first process found with one of its descriptors on the socket. Bounded:
/// at most [`MAX_PROCS`] processes and [`MAX_FDS`] descriptors are looked
/// at. Reads only kernel files under `/proc` (descriptor links are read,
/// never followed).
pub fn holder(port: u16) -> Option<Holder> {
    let mut found = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(table) {
            found.extend(listeners(&text, port));
        }
    }
    if found.is_empty() {
        return None;
    }
    let wanted: HashMap<String, u32> = found
        .iter()
        .map(|l| (format!("socket:[{}]", l.inode), l.uid))
        .collect();
    let mut fds_left = MAX_FDS;
    let procs = std::fs::read_dir("/proc").ok()?;
    for e in procs.flatten().take(MAX_PROCS) {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if fds_left == 0 {
                return None;
            }
            fds_left -= 1;
            let Ok(link) = std::fs::read_link(fd.path()) else {
                continue;
            };
            if let Some(uid) = link.to_str().and_then(|l| wanted.get(l)) {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .map(|c| c.trim_end().chars().take(64).collect())
                    .unwrap_or_default();
                return Some(Holder {
                    pid,
                    comm,
                    uid: *uid,
                });
            }
        }
    }
    None
}

/// One rank this agent runs, for naming a holder.
#[derive(Clone, Debug)]
pub struct RankOf {
    /// Job.
    pub job: gangway_core::JobId,
    /// Its owner (empty when not known, as for an adopted rank).
    pub user: String,
    /// Global rank.
    pub rank: u32,
    /// The rank's container.
    pub container: Container,
}

/// How a holder reads in the server's event: `job 7 (alice) rank 0, pid
/// 1234` when it is a process of one of `ranks`, else `process nc (uid 0),
/// pid 1234`.
pub fn describe(h: &Holder, ranks: &[RankOf], track: &SharedTrack) -> String {
    let comm: String = h
        .comm
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    for r in ranks {
        if track.pids(&r.container).contains(&h.pid) {
            let user = if r.user.is_empty() {
                String::new()
            } else {
                format!(" ({})", r.user)
            };
            return format!("job {}{user} rank {}, pid {}", r.job, r.rank, h.pid);
        }
    }
    format!("process {comm} (uid {}), pid {}", h.uid, h.pid)
}

/// [`holder`] and [`describe`] on a blocking thread, given up after a
/// couple of seconds.
pub async fn name_holder(port: u16, ranks: Vec<RankOf>, track: SharedTrack) -> Option<String> {
    let work =
        tokio::task::spawn_blocking(move || holder(port).map(|h| describe(&h, &ranks, &track)));
    match tokio::time::timeout(HOLDER_TIMEOUT, work).await {
        Ok(Ok(named)) => named,
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:72D8 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001        0 4242 1 0000000000000000 100 0 0 10 0
   1: 0100007F:72D8 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1001        0 4343 1 0000000000000000 20 4 30 10 -1
   2: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 99 1 0000000000000000 100 0 0 10 0
   3: garbage
";

    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:72D8 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 777 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn listen_sockets_on_a_port_are_read_from_proc_net_tcp() {
        // 0x72D8 = 29400; the established socket on it is not a listener.
        assert_eq!(
            listeners(TCP, 29_400),
            vec![Listener {
                inode: 4242,
                uid: 1001
            }]
        );
        assert_eq!(listeners(TCP, 8080), vec![Listener { inode: 99, uid: 0 }]);
        assert!(listeners(TCP, 29_401).is_empty());
        assert_eq!(
            listeners(TCP6, 29_400),
            vec![Listener { inode: 777, uid: 0 }]
        );
        assert!(listeners("", 29_400).is_empty());
    }

    /// A tracker that knows one container holding one pid.
    struct OnePid(i32);

    impl crate::proctrack::ProcTrack for OnePid {
        fn kind(&self) -> crate::proctrack::ProcTrackKind {
            crate::proctrack::ProcTrackKind::Subreaper
        }
        fn create(
            &self,
            name: &str,
            _: crate::proctrack::Limits,
        ) -> Result<Container, crate::proctrack::ProcTrackError> {
            Ok(Container {
                name: name.into(),
                cgroups: Vec::new(),
            })
        }
        fn join(&self, _: &Container) -> crate::proctrack::Join {
            crate::proctrack::Join::default()
        }
        fn adopt(&self, _: &Container, _: i32) {}
        fn pids(&self, c: &Container) -> Vec<i32> {
            if c.name == "r0" {
                vec![self.0]
            } else {
                Vec::new()
            }
        }
        fn destroy(&self, _: &Container) {}
    }

    #[test]
    fn a_holder_is_named_as_a_rank_when_it_is_one_else_by_process_and_uid() {
        let track: SharedTrack = Arc::new(OnePid(1234));
        let rank = |name: &str, job: u64, user: &str| RankOf {
            job: gangway_core::JobId(job),
            user: user.into(),
            rank: 0,
            container: Container {
                name: name.into(),
                cgroups: Vec::new(),
            },
        };
        let ranks = vec![rank("r1", 3, "bob"), rank("r0", 7, "alice")];
        let h = Holder {
            pid: 1234,
            comm: "python3".into(),
            uid: 1001,
        };
        assert_eq!(
            describe(&h, &ranks, &track),
            "job 7 (alice) rank 0, pid 1234"
        );
        let stranger = Holder {
            pid: 99,
            comm: "nc\u{1b}[2J".into(),
            uid: 0,
        };
        assert_eq!(
            describe(&stranger, &ranks, &track),
            "process nc?[2J (uid 0), pid 99",
            "control characters of a name are not passed on"
        );
    }

    #[test]
    fn the_process_listening_on_a_port_is_found() {
        let l = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("bind");
        let port = l.local_addr().expect("addr").port();
        let h = holder(port).expect("found");
        // This process, or a child another test forked meanwhile (it
        // shares the descriptor until it execs or exits).
        let me = std::process::id() as i32;
        let parent = crate::proctrack::proc_info(h.pid).map(|p| p.ppid);
        assert!(h.pid == me || parent == Some(me), "{h:?}");
        assert_eq!(h.uid, nix::unistd::geteuid().as_raw());
        drop(l);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while holder(port).is_some() {
            assert!(
                std::time::Instant::now() < deadline,
                "something still listens"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}
