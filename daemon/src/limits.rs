//! Process limits a daemon raises at start ([`raise_open_files`]).
//!
//! Every session or attachment holds a few descriptors (a socket, eventfds, an io_uring),
//! so a thousand of them pass the soft limit of 1,024 open files that a login shell or a
//! systemd unit starts a process with. The hard limit is the operator's word
//! (`ulimit -Hn`, `LimitNOFILE=`); the soft one is raised to it, as daemons that serve
//! many connections do.

/// Raises the soft limit of open files (`RLIMIT_NOFILE`) to the hard limit. Returns
/// the soft limit in force afterwards, or `None` when it could not be read.
pub fn raise_open_files() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct it is given, which lives on this stack.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    Some(lim.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_of_open_files_reaches_the_hard_one() {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as in raise_open_files.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        let lower = libc::rlimit {
            rlim_cur: lim.rlim_max.min(256),
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as in raise_open_files.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lower) }, 0);
        assert_eq!(raise_open_files(), Some(lim.rlim_max));
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert_eq!(lim.rlim_cur, lim.rlim_max);
    }
}
