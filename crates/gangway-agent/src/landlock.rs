//! Rendezvous ports only their job may bind: every process rank runs under
//! a Landlock domain (ABI 4 and later, `LANDLOCK_ACCESS_NET_BIND_TCP`) that
//! lets it bind every TCP port except the cluster's rendezvous range, and,
//! for a job's rank 0, that job's own `MASTER_PORT`. Port 0 (an ephemeral
//! port the kernel picks) stays allowed. The domain is inherited by every
//! descendant (launchers, forks), and a process cannot leave it.
//!
//! Landlock has no port ranges: a ruleset is one rule per allowed port
//! (about 62,000 `landlock_add_rule` calls), so rulesets are built before
//! the fork, off the agent's async loop, and only the
//! [`restrict_self`] call runs between fork and exec. Raw system calls with
//! the kernel's structure layouts (`include/uapi/linux/landlock.h`).

use gangway_core::agent::PortRange;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

/// `LANDLOCK_CREATE_RULESET_VERSION`: ask for the ABI version.
const CREATE_RULESET_VERSION: u32 = 1;
/// `LANDLOCK_RULE_NET_PORT`.
const RULE_NET_PORT: libc::c_int = 2;
/// `LANDLOCK_ACCESS_NET_BIND_TCP`.
const ACCESS_NET_BIND_TCP: u64 = 1;
/// First ABI with network rules.
const NET_ABI: i64 = 4;

/// `struct landlock_ruleset_attr` up to `handled_access_net` (ABI 4): a
/// shorter size is accepted by later kernels, the rest taken as zero.
#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
}

/// `struct landlock_net_port_attr`.
#[repr(C)]
struct NetPortAttr {
    allowed_access: u64,
    port: u64,
}

/// Why a ruleset could not be made.
#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    /// The kernel has no Landlock, or none with network rules.
    #[error("Landlock network rules are not available: {0}")]
    Unavailable(String),
    /// A system call failed.
    #[error("Landlock {call}: {err}")]
    Call {
        /// Which call.
        call: &'static str,
        /// Its error.
        err: std::io::Error,
    },
}

/// Whether this kernel has Landlock network rules: `Ok(abi)` or why not
/// (asked once).
pub fn support() -> Result<i64, String> {
    static ABI: OnceLock<Result<i64, String>> = OnceLock::new();
    ABI.get_or_init(|| {
        // SAFETY: the version query takes no pointer.
        let abi = unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                std::ptr::null::<RulesetAttr>(),
                0usize,
                CREATE_RULESET_VERSION,
            )
        };
        if abi < 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ENOSYS) => "the kernel has no Landlock (ENOSYS)".to_string(),
                Some(libc::EOPNOTSUPP) => {
                    "Landlock is disabled on this kernel (EOPNOTSUPP; see the lsm= boot option)"
                        .to_string()
                }
                _ => format!("Landlock version query: {e}"),
            });
        }
        if abi < NET_ABI {
            return Err(format!(
                "the kernel's Landlock ABI is {abi}; network rules need ABI {NET_ABI} (Linux 6.7)"
            ));
        }
        Ok(abi)
    })
    .clone()
}

/// A Landlock ruleset that handles only TCP binds: the ports it allows are
/// every port outside the rendezvous range, port 0, and the job's own port
/// where it has one.
#[derive(Debug)]
pub struct PortRules {
    fd: OwnedFd,
    /// The range it keeps ranks out of.
    pub range: PortRange,
    /// The one port of the range it allows.
    pub own: Option<u16>,
}

impl PortRules {
    /// Builds the ruleset (about 62,000 system calls for the default range:
    /// call it off the async loop).
    pub fn build(range: PortRange, own: Option<u16>) -> Result<PortRules, LandlockError> {
        support().map_err(LandlockError::Unavailable)?;
        let attr = RulesetAttr {
            handled_access_fs: 0,
            handled_access_net: ACCESS_NET_BIND_TCP,
        };
        // SAFETY: `attr` is a live struct of the size passed.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                &attr as *const RulesetAttr,
                std::mem::size_of::<RulesetAttr>(),
                0u32,
            )
        };
        if fd < 0 {
            return Err(LandlockError::Call {
                call: "create_ruleset",
                err: std::io::Error::last_os_error(),
            });
        }
        let fd = RawFd::try_from(fd).map_err(|_| LandlockError::Call {
            call: "create_ruleset",
            err: std::io::Error::other("descriptor out of range"),
        })?;
        // SAFETY: a descriptor the kernel just returned, owned by nobody else
        // (created with O_CLOEXEC: ranks do not keep it after exec).
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        for port in 0..=u16::MAX {
            let in_range = !range.is_empty() && port >= range.first && port <= range.last;
            if in_range && own != Some(port) {
                continue;
            }
            let rule = NetPortAttr {
                allowed_access: ACCESS_NET_BIND_TCP,
                port: u64::from(port),
            };
            // SAFETY: `rule` is a live struct of the layout the rule type names.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_landlock_add_rule,
                    fd.as_raw_fd(),
                    RULE_NET_PORT,
                    &rule as *const NetPortAttr,
                    0u32,
                )
            };
            if r != 0 {
                return Err(LandlockError::Call {
                    call: "add_rule",
                    err: std::io::Error::last_os_error(),
                });
            }
        }
        Ok(PortRules { fd, range, own })
    }

    /// The ruleset's descriptor, for [`restrict_self`] in a child.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Puts the calling process (and all it will start) under the ruleset.
/// Needs `PR_SET_NO_NEW_PRIVS` set first (or `CAP_SYS_ADMIN`).
///
/// # Safety
/// Meant for a child between fork and exec: one system call, nothing else.
/// `fd` must be a Landlock ruleset descriptor still open in the process.
pub unsafe fn restrict_self(fd: RawFd) -> std::io::Result<()> {
    if libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32) != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Binds `port` on 127.0.0.1 in a forked child under `rules`; the
    /// child's errno (0 when the bind worked).
    fn bind_in_child(rules: &PortRules, port: u16) -> i32 {
        in_child(rules, port, false, false)
    }

    /// [`bind_in_child`] on `::1` (`v6`), and in a grandchild the ruled
    /// child forks (`grandchild`: descendants inherit the domain).
    fn in_child(rules: &PortRules, port: u16, v6: bool, grandchild: bool) -> i32 {
        let fd = rules.raw_fd();
        // SAFETY: the child makes only system calls and _exits.
        unsafe {
            let pid = libc::fork();
            assert!(pid >= 0, "fork");
            if pid == 0 {
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                    || restrict_self(fd).is_err()
                {
                    libc::_exit(100);
                }
                if grandchild {
                    let g = libc::fork();
                    if g < 0 {
                        libc::_exit(101);
                    }
                    if g > 0 {
                        let mut status = 0;
                        libc::waitpid(g, &mut status, 0);
                        libc::_exit(if libc::WIFEXITED(status) {
                            libc::WEXITSTATUS(status)
                        } else {
                            102
                        });
                    }
                }
                let family = if v6 { libc::AF_INET6 } else { libc::AF_INET };
                let s = libc::socket(family, libc::SOCK_STREAM, 0);
                let one: libc::c_int = 1;
                libc::setsockopt(
                    s,
                    libc::SOL_SOCKET,
                    libc::SO_REUSEADDR,
                    (&one as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as u32,
                );
                let r = if v6 {
                    let addr = libc::sockaddr_in6 {
                        sin6_family: libc::AF_INET6 as libc::sa_family_t,
                        sin6_port: port.to_be(),
                        sin6_flowinfo: 0,
                        sin6_addr: libc::in6_addr {
                            s6_addr: std::net::Ipv6Addr::LOCALHOST.octets(),
                        },
                        sin6_scope_id: 0,
                    };
                    libc::bind(
                        s,
                        (&addr as *const libc::sockaddr_in6).cast(),
                        std::mem::size_of::<libc::sockaddr_in6>() as u32,
                    )
                } else {
                    let addr = libc::sockaddr_in {
                        sin_family: libc::AF_INET as libc::sa_family_t,
                        sin_port: port.to_be(),
                        sin_addr: libc::in_addr {
                            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
                        },
                        sin_zero: [0; 8],
                    };
                    libc::bind(
                        s,
                        (&addr as *const libc::sockaddr_in).cast(),
                        std::mem::size_of::<libc::sockaddr_in>() as u32,
                    )
                };
                let code = if r == 0 { 0 } else { *libc::__errno_location() };
                libc::_exit(code);
            }
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
            assert!(libc::WIFEXITED(status), "child exited");
            libc::WEXITSTATUS(status)
        }
    }

    /// A free port of the range (nothing listens there now).
    fn free_in(range: PortRange) -> u16 {
        (range.first..=range.last)
            .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
            .expect("a free port")
    }

    #[test]
    fn a_ruled_process_binds_outside_the_range_and_port_0_but_not_in_it() {
        if let Err(why) = support() {
            return gangway_store::testing::skip_or_fail("GANGWAY_REQUIRE_LANDLOCK", &why);
        }
        let range = PortRange {
            first: 41_000,
            last: 41_099,
        };
        let own = free_in(range);
        let t = std::time::Instant::now();
        let rules = PortRules::build(range, Some(own)).expect("rules");
        eprintln!("ruleset built in {:?}", t.elapsed());
        let other = (range.first..=range.last)
            .filter(|p| *p != own)
            .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
            .expect("another free port");
        assert_eq!(bind_in_child(&rules, other), libc::EACCES, "port {other}");
        assert_eq!(bind_in_child(&rules, own), 0, "its own port {own}");
        assert_eq!(bind_in_child(&rules, 0), 0, "an ephemeral port");
        let outside = (42_000..43_000)
            .find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
            .expect("a free port outside");
        assert_eq!(bind_in_child(&rules, outside), 0, "port {outside}");
        // Over IPv6 and from a descendant alike.
        assert_eq!(
            in_child(&rules, other, true, false),
            libc::EACCES,
            "[::1]:{other}"
        );
        assert_eq!(
            in_child(&rules, other, false, true),
            libc::EACCES,
            "grandchild"
        );
        assert_eq!(in_child(&rules, other, true, true), libc::EACCES);
        assert_eq!(
            in_child(&rules, 0, true, true),
            0,
            "[::1]:0 from a grandchild"
        );
        let base = PortRules::build(range, None).expect("rules");
        assert_eq!(bind_in_child(&base, own), libc::EACCES, "not its port");
    }
}
