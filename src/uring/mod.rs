//! The io_uring driver: ring setup with a flag fallback chain, fixed bounce buffers, and the
//! doorbell read that lets one `io_uring_enter` wait for both I/O and new work.

use std::io;

use io_uring::{IoUring, Probe, opcode, squeue, types};

use crate::lane::{Completion, IoKind, IoRequest, Lane, LaneIo};

/// Which setup flags the ring got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingFlags {
    /// `IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN` (Linux 6.1+): completions are
    /// processed only when the reactor asks, on its own thread.
    SingleIssuerDeferTaskrun,
    /// `IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG` (Linux 5.19+).
    CoopTaskrun,
    /// No optional flags.
    Plain,
    /// `IORING_SETUP_SQPOLL | IORING_SETUP_SINGLE_ISSUER` (asked for with
    /// `EngineBuilder::submission_polling`): a kernel thread takes the reactor's submissions.
    SqPoll,
}

impl std::fmt::Display for RingFlags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RingFlags::SingleIssuerDeferTaskrun => "SINGLE_ISSUER|DEFER_TASKRUN|TASKRUN_FLAG",
            RingFlags::CoopTaskrun => "COOP_TASKRUN|TASKRUN_FLAG",
            RingFlags::Plain => "plain",
            RingFlags::SqPoll => "SQPOLL|SINGLE_ISSUER",
        })
    }
}

/// Builds a ring with the best flags the kernel accepts. Returns the ring, its flags and one
/// line per refused attempt.
///
/// `sqpoll`: ask first for a kernel thread that polls the submission queue and goes to sleep
/// after this long without work. It then pays the submission path (for a fast block device,
/// the driver's own work too) instead of the reactor, for up to a core while busy. Refused
/// (an old kernel, or no permission before Linux 5.11), the ring is set up as without it.
pub(crate) fn setup_ring(
    entries: u32,
    sqpoll: Option<std::time::Duration>,
) -> io::Result<(IoUring, RingFlags, Vec<String>)> {
    let mut refused = Vec::new();
    if let Some(idle) = sqpoll {
        let idle_ms = u32::try_from(idle.as_millis()).unwrap_or(u32::MAX).max(1);
        match IoUring::builder()
            .setup_sqpoll(idle_ms)
            .setup_single_issuer()
            .build(entries)
        {
            Ok(r) => return Ok((r, RingFlags::SqPoll, refused)),
            Err(e) => refused.push(format!("SQPOLL refused: {e}")),
        }
    }
    match IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_taskrun_flag()
        .build(entries)
    {
        Ok(r) => return Ok((r, RingFlags::SingleIssuerDeferTaskrun, refused)),
        Err(e) => refused.push(format!("SINGLE_ISSUER|DEFER_TASKRUN refused: {e}")),
    }
    match IoUring::builder()
        .setup_coop_taskrun()
        .setup_taskrun_flag()
        .build(entries)
    {
        Ok(r) => return Ok((r, RingFlags::CoopTaskrun, refused)),
        Err(e) => refused.push(format!("COOP_TASKRUN refused: {e}")),
    }
    match IoUring::builder().build(entries) {
        Ok(r) => Ok((r, RingFlags::Plain, refused)),
        Err(e) => {
            let hint = match std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled") {
                Ok(v) if v.trim() != "0" => {
                    format!(" (kernel.io_uring_disabled = {})", v.trim())
                }
                _ => String::new(),
            };
            Err(io::Error::new(
                e.kind(),
                format!("io_uring_setup failed: {e}{hint}"),
            ))
        }
    }
}

/// Opcodes gpuio needs, checked with `IORING_REGISTER_PROBE`.
fn check_opcodes(ring: &IoUring) -> io::Result<bool> {
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    for (code, name) in [
        (opcode::Read::CODE, "READ"),
        (opcode::Write::CODE, "WRITE"),
        (opcode::Fsync::CODE, "FSYNC"),
    ] {
        if !probe.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("io_uring lacks IORING_OP_{name}"),
            ));
        }
    }
    Ok(probe.is_supported(opcode::ReadFixed::CODE) && probe.is_supported(opcode::WriteFixed::CODE))
}

const DOORBELL_TOKEN: u64 = u64::MAX;
/// The timeout SQE that bounds a timed wait on kernels without `IORING_ENTER_EXT_ARG`.
const TIMEOUT_TOKEN: u64 = u64::MAX - 1;

/// How the engine asks for its ring.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UringOptions {
    /// Timed waits may pass their timeout to io_uring_enter (`false`: tests of old kernels).
    pub(crate) ext_arg: bool,
    /// Submission-queue polling with this idle time (`EngineBuilder::submission_polling`).
    pub(crate) sqpoll: Option<std::time::Duration>,
}

/// io_uring driver. Lives on the reactor thread (SINGLE_ISSUER requires it).
pub(crate) struct UringLane {
    ring: IoUring,
    flags: RingFlags,
    fixed_buffers: bool,
    fixed_note: String,
    doorbell_fd: i32,
    doorbell_buf: Box<u64>,
    doorbell_armed: bool,
    /// Timed waits pass their timeout to io_uring_enter (`IORING_ENTER_EXT_ARG`, Linux 5.11+);
    /// without it they queue a timeout SQE instead (Linux 5.6–5.10).
    ext_arg: bool,
    /// The timespec of the timeout SQE (the kernel copies it at submission; kept here anyway so
    /// the SQE never points at a dead stack frame).
    timeout_ts: Box<types::Timespec>,
    timeout_armed: bool,
    refused: Vec<String>,
    /// Pieces pushed and not yet reaped.
    out: usize,
}

impl UringLane {
    /// Sets up a ring for `depth` concurrent I/Os and registers `iovecs` as fixed buffers where
    /// the kernel (and RLIMIT_MEMLOCK) allows.
    ///
    /// # Safety
    /// The memory behind `iovecs` must stay mapped for the life of the driver (the bounce arena
    /// is kept alive by the reactor, which drops the driver first).
    /// `ext_arg_allowed: false` forces the timeout-SQE path (tests of old kernels).
    /// `iowq_workers` caps the ring's bounded io-wq workers (the ones that copy buffered file
    /// pieces sent with `IOSQE_ASYNC`); `None` keeps the kernel's limit.
    pub(crate) unsafe fn new(
        depth: u32,
        iowq_workers: Option<u32>,
        iovecs: &[libc::iovec],
        doorbell_fd: i32,
        opts: UringOptions,
    ) -> io::Result<Self> {
        // One more entry for the doorbell read and one for a timeout SQE. At most `depth`
        // pieces are ever out, so the submission queue never fills, even while a polling
        // kernel thread has not yet taken what was pushed.
        let entries = (depth + 2).next_power_of_two().max(8);
        let (ring, flags, mut refused) = setup_ring(entries, opts.sqpoll)?;
        let ext_arg_allowed = opts.ext_arg;
        let ext_arg = ext_arg_allowed && ring.params().is_feature_ext_arg();
        if !ext_arg {
            refused.push(if ext_arg_allowed {
                "kernel lacks IORING_FEAT_EXT_ARG: timed waits use a timeout SQE".to_string()
            } else {
                "IORING_ENTER_EXT_ARG turned off: timed waits use a timeout SQE".to_string()
            });
        }
        if let Some(n) = iowq_workers {
            // [bounded, unbounded]; 0 leaves a class as it is. Linux 5.15+: older kernels
            // refuse it, and the kernel's limit (four per CPU) stays.
            let mut max = [n, 0];
            if let Err(e) = ring.submitter().register_iowq_max_workers(&mut max) {
                refused.push(format!(
                    "io-wq worker limit {n} refused ({e}): the kernel's stays"
                ));
            } else {
                refused.push(format!("io-wq workers at most {n}"));
            }
        }
        let fixed_ok = check_opcodes(&ring)?;
        let (fixed_buffers, fixed_note) = if !fixed_ok {
            (false, "kernel lacks READ_FIXED/WRITE_FIXED".to_string())
        } else if iovecs.len() > u16::MAX as usize {
            (false, "too many bounce blocks to register".to_string())
        } else {
            // SAFETY: the caller guarantees the iovecs' memory outlives the ring.
            match unsafe { ring.submitter().register_buffers(iovecs) } {
                Ok(()) => (true, format!("{} bounce blocks registered", iovecs.len())),
                Err(e) => (
                    false,
                    format!("buffer registration refused ({e}); RLIMIT_MEMLOCK may be too low"),
                ),
            }
        };
        Ok(UringLane {
            ring,
            flags,
            fixed_buffers,
            fixed_note,
            doorbell_fd,
            doorbell_buf: Box::new(0),
            doorbell_armed: false,
            ext_arg,
            timeout_ts: Box::new(types::Timespec::new()),
            timeout_armed: false,
            refused,
            out: 0,
        })
    }

    /// A one-line description for `BackendInfo`.
    fn description(&self) -> String {
        let mut s = format!(
            "io_uring ({}), fixed buffers: {}",
            self.flags,
            if self.fixed_buffers { "yes" } else { "no" }
        );
        s.push_str(&format!(" ({})", self.fixed_note));
        for r in &self.refused {
            s.push_str(&format!("; {r}"));
        }
        s
    }

    fn push_sqe(&mut self, sqe: squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: every SQE built by this driver points at memory that stays valid until its
            // CQE is reaped: bounce slots (owned by the reactor until completion), or the
            // driver's own doorbell buffer and timeout timespec (boxed, dropped after the ring).
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                return Ok(());
            }
            // Submission queue full: hand what is queued to the kernel and retry.
            self.submit(false)?;
        }
    }

    /// Queues one I/O.
    fn push_request(&mut self, req: IoRequest) -> io::Result<()> {
        let fd = types::Fd(req.fd);
        let sqe = match (req.kind, req.fixed.filter(|_| self.fixed_buffers)) {
            (IoKind::Read, Some(idx)) => opcode::ReadFixed::new(fd, req.buf, req.len, idx)
                .offset(req.pos)
                .build(),
            (IoKind::Read, None) => opcode::Read::new(fd, req.buf, req.len)
                .offset(req.pos)
                .build(),
            (IoKind::Write, Some(idx)) => opcode::WriteFixed::new(fd, req.buf, req.len, idx)
                .offset(req.pos)
                .build(),
            (IoKind::Write, None) => opcode::Write::new(fd, req.buf, req.len)
                .offset(req.pos)
                .build(),
            (IoKind::Fsync, _) => opcode::Fsync::new(fd).build(),
        };
        let sqe = if req.punt {
            sqe.flags(squeue::Flags::ASYNC)
        } else {
            sqe
        };
        self.push_sqe(sqe.user_data(req.token))
    }

    fn submit(&mut self, wait: bool) -> io::Result<()> {
        self.submit_timeout(wait, None)
    }

    fn submit_timeout(
        &mut self,
        wait: bool,
        timeout: Option<std::time::Duration>,
    ) -> io::Result<()> {
        let r = match (wait, timeout) {
            (true, Some(t)) if !self.ext_arg => {
                // A timeout SQE that also completes at the first other completion (count 1),
                // so at most one is ever queued and it never outlives the wait by much.
                if !self.timeout_armed {
                    *self.timeout_ts = types::Timespec::new()
                        .sec(t.as_secs())
                        .nsec(t.subsec_nanos());
                    let sqe = opcode::Timeout::new(&*self.timeout_ts)
                        .count(1)
                        .build()
                        .user_data(TIMEOUT_TOKEN);
                    self.push_sqe(sqe)?;
                    self.timeout_armed = true;
                }
                self.ring.submit_and_wait(1)
            }
            (true, Some(t)) => {
                let ts = types::Timespec::new()
                    .sec(t.as_secs())
                    .nsec(t.subsec_nanos());
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
            }
            (true, None) => self.ring.submit_and_wait(1),
            (false, _) => self.ring.submit(),
        };
        match r {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EBUSY | libc::EAGAIN | libc::ETIME)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Submits queued I/O; if `block`, waits for a completion or the doorbell. Appends
    /// completions (never the doorbell's) to `out`.
    fn wait_ring(
        &mut self,
        block: bool,
        timeout: Option<std::time::Duration>,
        out: &mut Vec<Completion>,
    ) -> io::Result<()> {
        if block && !self.doorbell_armed {
            let sqe = opcode::Read::new(
                types::Fd(self.doorbell_fd),
                (&mut *self.doorbell_buf as *mut u64).cast(),
                8,
            )
            .build()
            .user_data(DOORBELL_TOKEN);
            self.push_sqe(sqe)?;
            self.doorbell_armed = true;
        }
        // With DEFER_TASKRUN completions are only posted from io_uring_enter(GETEVENTS).
        // TASKRUN_FLAG makes the kernel raise IORING_SQ_TASKRUN when such work is pending, and
        // the io-uring crate then adds GETEVENTS to a non-blocking submit too, so a reactor that
        // never sleeps still reaps its completions.
        self.submit_timeout(block, timeout)?;
        for cqe in self.ring.completion() {
            if cqe.user_data() == DOORBELL_TOKEN {
                self.doorbell_armed = false;
            } else if cqe.user_data() == TIMEOUT_TOKEN {
                self.timeout_armed = false;
            } else {
                self.out -= 1;
                out.push(Completion {
                    token: cqe.user_data(),
                    res: cqe.result(),
                });
            }
        }
        Ok(())
    }

    /// Retires the doorbell read before the ring and its buffer go away: rings the eventfd
    /// ourselves and waits for that read's completion, so the kernel never writes the freed box.
    fn retire_doorbell(&mut self, ring_eventfd: &dyn Fn()) -> io::Result<()> {
        let mut sink = Vec::new();
        while self.doorbell_armed {
            ring_eventfd();
            self.submit(true)?;
            for cqe in self.ring.completion() {
                match cqe.user_data() {
                    DOORBELL_TOKEN => self.doorbell_armed = false,
                    // Timeouts touch no memory of ours once submitted.
                    TIMEOUT_TOKEN => self.timeout_armed = false,
                    other => sink.push(other),
                }
            }
            debug_assert!(sink.is_empty(), "I/O completed after the drain");
        }
        Ok(())
    }
}

impl Lane for UringLane {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn describe(&self) -> String {
        self.description()
    }

    fn push(&mut self, io: LaneIo<'_>) -> io::Result<()> {
        self.push_request(io.kernel_request())?;
        self.out += 1;
        Ok(())
    }

    fn wait(
        &mut self,
        block: bool,
        timeout: Option<std::time::Duration>,
        out: &mut Vec<Completion>,
    ) -> io::Result<()> {
        self.wait_ring(block, timeout, out)
    }

    fn outstanding(&self) -> usize {
        self.out
    }

    fn uses_fixed_buffers(&self) -> bool {
        self.fixed_buffers
    }

    fn copies_on_kernel_workers(&self) -> bool {
        true
    }

    fn retire(&mut self, wake: &dyn Fn()) -> io::Result<()> {
        self.retire_doorbell(wake)
    }
}

/// What `gpuio check` reports about io_uring on this machine.
#[derive(Debug, Clone)]
pub struct UringProbe {
    /// Whether a ring could be created.
    pub available: bool,
    /// The setup flags the kernel accepted.
    pub flags: Option<RingFlags>,
    /// Refused flag sets and other notes.
    pub notes: Vec<String>,
    /// `kernel.io_uring_disabled`, where readable.
    pub disabled_sysctl: Option<String>,
}

/// Tries to set up a small ring the way the engine would.
pub fn probe() -> UringProbe {
    let disabled_sysctl = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .map(|s| s.trim().to_string());
    match setup_ring(8, None) {
        Ok((_ring, flags, notes)) => UringProbe {
            available: true,
            flags: Some(flags),
            notes,
            disabled_sysctl,
        },
        Err(e) => UringProbe {
            available: false,
            flags: None,
            notes: vec![e.to_string()],
            disabled_sysctl,
        },
    }
}
