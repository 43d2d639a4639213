//! The node's side of rendezvous ports: the Landlock rulesets that keep
//! process ranks off the cluster's rendezvous range (built off the async
//! loop, kept per range; one that cannot be built is logged and the ranks
//! start without it), and naming whoever holds a port rank 0 could
//! not bind (`/proc/net/tcp{,6}` LISTEN sockets → socket inode → the
//! process whose descriptor it is → the rank whose container holds it).

use crate::landlock::PortRules;
use crate::proctrack::{Container, SharedTrack};
use gangway_core::agent::PortRange;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Most rank rulesets of the range kept (one per range the server sent).
const MAX_RANGES: usize = 4;

/// Most rank-0 rulesets and holder names waiting for their start.
const MAX_WAITING: usize = 256;

/// How long a rank-0 ruleset or a holder's name waits for its start (a job
/// moved or cancelled before it started leaves one behind; a ruleset holds
/// a few MiB of kernel memory).
const WAITING: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a holder's name is good for (the holder may go, another come).
const HOLDER_WAITING: std::time::Duration = std::time::Duration::from_secs(10);

/// Most processes looked at when naming a port's holder.
pub const MAX_PROCS: usize = 8192;

/// Most descriptors read when naming a port's holder (all processes).
pub const MAX_FDS: usize = 262_144;

/// A ruleset, or `None` where it could not be built (logged).
type Rules = Option<Arc<PortRules>>;

/// What a start waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Need {
    /// Every rank's ruleset for the range.
    Base(PortRange),
    /// Rank 0's, with its own port.
    Own(PortRange, u16),
    /// The name of whoever holds this port.
    Holder(u16),
}

/// What was made for a start, off the async loop.
enum Made {
    Rules(Need, Rules),
    Holder(u16, Option<String>),
}

/// What a job's start needs from this node's rendezvous side, prepared on
/// a worker thread so the agent's loop never waits for it: the rank
/// rulesets (a ruleset is about 62,000 system calls), kept per range, and
/// rank 0's with its own port, and the name of a busy port's holder (a
/// bounded `/proc` scan). A start asks with [`Prepared::rules`] or
/// [`Prepared::holder`]; `None` means "being made": the start is put off
/// and [`Prepared::poll`] says when something is ready.
pub struct Prepared {
    base: HashMap<PortRange, Rules>,
    own: HashMap<(PortRange, u16), (Instant, Rules)>,
    holders: HashMap<u16, (Instant, Option<String>)>,
    making: std::collections::HashSet<Need>,
    tx: tokio::sync::mpsc::UnboundedSender<Made>,
    rx: tokio::sync::mpsc::UnboundedReceiver<Made>,
    /// The one thread that makes them, in turn and at a lower priority:
    /// thirty rulesets built at once would starve the agent's loop of CPU.
    worker: Option<std::sync::mpsc::Sender<Box<dyn FnOnce() + Send>>>,
}

impl Default for Prepared {
    fn default() -> Self {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        Prepared {
            base: HashMap::new(),
            own: HashMap::new(),
            holders: HashMap::new(),
            making: Default::default(),
            tx,
            rx,
            worker: None,
        }
    }
}

impl Prepared {
    /// The rulesets of one job's ranks here: every rank's (the range
    /// closed) and rank 0's (the range closed but `own`, its port; every
    /// rank's when `own` is `None`). `Some((None, None))` where the kernel
    /// has no Landlock network rules (the agent says so when it starts): a
    /// held port is then only detected when rank 0 starts. `None` while
    /// they are being built. Rank 0's is handed out once.
    pub fn rules(&mut self, range: PortRange, own: Option<u16>) -> Option<(Rules, Rules)> {
        if crate::landlock::support().is_err() {
            return Some((None, None));
        }
        let base = match self.base.get(&range) {
            Some(b) => b.clone(),
            None => {
                self.make_rules(Need::Base(range));
                if let Some(p) = own {
                    self.make_rules(Need::Own(range, p));
                }
                return None;
            }
        };
        let Some(p) = own else {
            return Some((base.clone(), base));
        };
        match self.own.remove(&(range, p)) {
            Some((_, r)) => Some((base, r)),
            None => {
                self.make_rules(Need::Own(range, p));
                None
            }
        }
    }

    /// The name of whoever holds `port` ([`holder`], [`describe`]), once looked up
    /// (handed out once; `Some(None)`: it could not be told). `None` while
    /// it is being looked up.
    pub fn holder(
        &mut self,
        port: u16,
        ranks: Vec<RankOf>,
        track: &SharedTrack,
    ) -> Option<Option<String>> {
        if let Some((_, h)) = self.holders.remove(&port) {
            return Some(h);
        }
        if self.making.insert(Need::Holder(port)) {
            let (track, tx) = (track.clone(), self.tx.clone());
            self.run(Box::new(move || {
                let named = holder(port).map(|h| describe(&h, &ranks, &track));
                let _ = tx.send(Made::Holder(port, named));
            }));
        }
        None
    }

    /// Takes in what was made since the last call; whether anything was
    /// (a start put off may go ahead now).
    pub fn poll(&mut self) -> bool {
        let mut any = false;
        while let Ok(made) = self.rx.try_recv() {
            any = true;
            match made {
                Made::Rules(need, rules) => {
                    self.making.remove(&need);
                    match need {
                        Need::Base(range) => {
                            if self.base.len() >= MAX_RANGES {
                                self.base.clear();
                            }
                            self.base.insert(range, rules);
                        }
                        Need::Own(range, port) => {
                            if self.own.len() >= MAX_WAITING {
                                self.own.clear();
                            }
                            self.own.insert((range, port), (Instant::now(), rules));
                        }
                        Need::Holder(_) => {}
                    }
                }
                Made::Holder(port, named) => {
                    self.making.remove(&Need::Holder(port));
                    if self.holders.len() >= MAX_WAITING {
                        self.holders.clear();
                    }
                    self.holders.insert(port, (Instant::now(), named));
                }
            }
        }
        self.own.retain(|_, (at, _)| at.elapsed() < WAITING);
        self.holders
            .retain(|_, (at, _)| at.elapsed() < HOLDER_WAITING);
        any
    }

    /// Whether something is being made (the loop then looks more often).
    pub fn making(&self) -> bool {
        !self.making.is_empty()
    }

    /// Builds a ruleset on a blocking thread, unless it is being built.
    fn make_rules(&mut self, need: Need) {
        if !self.making.insert(need) {
            return;
        }
        let (range, own) = match need {
            Need::Base(r) => (r, None),
            Need::Own(r, p) => (r, Some(p)),
            Need::Holder(_) => return,
        };
        let tx = self.tx.clone();
        self.run(Box::new(move || {
            let rules = match PortRules::build(range, own) {
                Ok(r) => Some(Arc::new(r)),
                Err(e) => {
                    tracing::error!(
                        "rendezvous ports {}-{}: {e}; ranks start without the port rule",
                        range.first,
                        range.last
                    );
                    None
                }
            };
            let _ = tx.send(Made::Rules(need, rules));
        }));
    }

    /// Hands `work` to the worker thread (started on first use, again if
    /// it is gone; where no thread can be started, the work is done here).
    fn run(&mut self, work: Box<dyn FnOnce() + Send>) {
        let work = match &self.worker {
            Some(w) => match w.send(work) {
                Ok(()) => return,
                Err(std::sync::mpsc::SendError(w)) => w,
            },
            None => work,
        };
        let (tx, rx) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let started = std::thread::Builder::new()
            .name("gangway-rendezvous".into())
            .spawn(move || {
                // SAFETY: gettid and setpriority on this thread only.
                unsafe {
                    let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                    libc::setpriority(libc::PRIO_PROCESS, tid, 10);
                }
                while let Ok(w) = rx.recv() {
                    w();
                }
            });
        match started {
            Ok(_) => match tx.send(work) {
                Ok(()) => self.worker = Some(tx),
                Err(std::sync::mpsc::SendError(w)) => w(),
            },
            Err(e) => {
                tracing::error!("cannot start the rendezvous worker thread: {e}");
                work();
            }
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
    fn a_start_is_put_off_until_its_rulesets_are_made_and_rank_0_s_is_handed_out_once() {
        if let Err(why) = crate::landlock::support() {
            return gangway_store::testing::skip_or_fail("GANGWAY_REQUIRE_LANDLOCK", &why);
        }
        let range = PortRange {
            first: 41_500,
            last: 41_599,
        };
        let mut p = Prepared::default();
        assert!(p.rules(range, Some(41_510)).is_none(), "being made");
        assert!(p.making());
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        let (base, own) = loop {
            p.poll();
            if let Some(r) = p.rules(range, Some(41_510)) {
                break r;
            }
            assert!(Instant::now() < deadline, "never made");
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let (base, own) = (base.expect("base"), own.expect("own"));
        assert_eq!((base.own, own.own), (None, Some(41_510)));
        // Other ranks of the range: at once, from the kept one.
        let (b2, o2) = p.rules(range, None).expect("kept");
        assert!(Arc::ptr_eq(&base, &b2.expect("base")) && o2.is_some());
        // Rank 0's was handed out: another start with that port makes another.
        assert!(p.rules(range, Some(41_510)).is_none());
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
