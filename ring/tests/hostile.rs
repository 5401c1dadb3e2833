//! A hostile peer: one process writes random bytes over the whole segment
//! (header, indices, sleep flags, slots, buffers) and sometimes plausible
//! descriptors and indices, while this process plays the daemon: it
//! consumes descriptors, validates them, takes provided buffers, writes
//! results and publishes completions.
//!
//! The daemon side maps the segment between two `PROT_NONE` guard regions,
//! so a single read or write outside the segment would kill this test with
//! SIGSEGV. It must never panic, and must report each bad index or entry as
//! an error value, which it counts.

#![cfg(not(loom))]

mod common;

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use stator_ring::header::{RingLayout, RingParams, word};
use stator_ring::session::{DaemonRing, TakeBufError};
use stator_ring::{BufEntry, BufRef, Cqe, Opcode, Sqe, Status};
use stator_shm::{Segment, ShmView};

fn params() -> RingParams {
    RingParams {
        sq_entries: 64,
        cq_entries: 64,
        buf_entries: 64,
        arena_len: 64 << 10,
        chunk_len: 4096,
    }
}

const GUARD: usize = 1 << 20;

/// Maps `seg` again at the centre of a reservation whose first and last
/// `GUARD` bytes are inaccessible.
struct Guarded {
    base: NonNull<libc::c_void>,
    total: usize,
}

impl Guarded {
    fn new(seg: &Segment) -> Guarded {
        use std::os::fd::AsRawFd;
        let total = seg.len() + 2 * GUARD;
        // SAFETY: a fresh anonymous PROT_NONE reservation; no existing memory
        // is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        // SAFETY: MAP_FIXED replaces only pages inside our own reservation.
        let mid = unsafe {
            libc::mmap(
                base.cast::<u8>().add(GUARD).cast(),
                seg.len(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                seg.fd().as_raw_fd(),
                0,
            )
        };
        assert_ne!(mid, libc::MAP_FAILED);
        Guarded {
            base: NonNull::new(base).unwrap(),
            total,
        }
    }

    fn view(&self, len: usize) -> ShmView<'_> {
        // SAFETY: `GUARD..GUARD+len` of the reservation is the shared mapping,
        // alive until `self` drops.
        unsafe {
            ShmView::from_raw(
                NonNull::new(self.base.as_ptr().cast::<u8>().add(GUARD)).unwrap(),
                len,
            )
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        // SAFETY: exactly the reservation made in `new`.
        unsafe { libc::munmap(self.base.as_ptr(), self.total) };
    }
}

#[derive(Default, Debug)]
struct Counts {
    valid: u64,
    bad_entries: u64,
    sq_index_errors: u64,
    cq_index_errors: u64,
    bad_buffers: u64,
    buffer_index_errors: u64,
    results_written: u64,
    too_large: u64,
}

#[test]
fn hostile_peer_cannot_crash_or_escape_the_consumer() {
    let layout = RingLayout::new(params()).unwrap();
    let seg = Segment::create(c"hostile", layout.total_len).unwrap();
    let guarded = Guarded::new(&seg);
    let view = guarded.view(seg.len());
    let mut ring = DaemonRing::create(view, params()).unwrap();
    let (mut child, sock, dir) = common::spawn_peer("scribbler_peer");
    stator_shm::fdpass::send_fds(&sock, b"scribble", &[seg.fd()]).unwrap();

    let arena = *ring.arena();
    let mut c = Counts::default();
    let mut key = vec![0u8; 64 << 10];
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        for _ in 0..64 {
            let sqe = match ring.sq.pop() {
                Ok(Some(s)) => s,
                Ok(None) => break,
                Err(_) => {
                    c.sq_index_errors += 1;
                    // Rewrite our own index so the scribbler's plausible
                    // rounds (tail = head + k) can reach validation again.
                    view.write(word::SQ_HEAD, &ring.sq.position()).unwrap();
                    break;
                }
            };
            let cqe = match sqe.validate(&arena) {
                Err(e) => {
                    c.bad_entries += 1;
                    Cqe::status(sqe.user_data, Status::from(e))
                }
                Ok(v) => {
                    c.valid += 1;
                    // Read every input range, as the daemon would.
                    for r in [v.key, v.namespace, v.user_key, v.value] {
                        ring.view().read_into(r.off, &mut key[..r.len]).unwrap();
                    }
                    let result = [0xABu8; 40];
                    if v.op.fields().output && v.buffer_select() {
                        match ring.take_buffer() {
                            Ok(Some(b)) if b.len >= result.len() => {
                                ring.view().write_from(b.seg_off, &result).unwrap();
                                c.results_written += 1;
                                Cqe {
                                    user_data: v.user_data,
                                    flags: 1,
                                    buf_id: b.buf_id,
                                    len: 40,
                                    ..Cqe::default()
                                }
                            }
                            Ok(Some(b)) => {
                                c.too_large += 1;
                                Cqe {
                                    user_data: v.user_data,
                                    status: Status::ResultTooLarge as i32,
                                    flags: 1,
                                    buf_id: b.buf_id,
                                    len: 40,
                                    aux: 0,
                                }
                            }
                            Ok(None) => Cqe::status(v.user_data, Status::NoBuffer),
                            Err(TakeBufError::Bad(_)) => {
                                c.bad_buffers += 1;
                                Cqe::status(v.user_data, Status::BadBuffer)
                            }
                            Err(_) => {
                                c.buffer_index_errors += 1;
                                let pos = ring.bufs.as_ref().unwrap().position();
                                view.write(word::BUF_HEAD, &pos).unwrap();
                                Cqe::status(v.user_data, Status::BadBuffer)
                            }
                        }
                    } else if v.op.fields().output {
                        let n = v.value.len.min(result.len());
                        ring.view().write_from(v.value.off, &result[..n]).unwrap();
                        c.results_written += 1;
                        Cqe {
                            user_data: v.user_data,
                            len: n as u32,
                            ..Cqe::default()
                        }
                    } else {
                        Cqe::status(v.user_data, Status::Ok)
                    }
                }
            };
            if ring.cq.push(&cqe).is_err() {
                c.cq_index_errors += 1;
                view.write(word::CQ_TAIL, &ring.cq.position()).unwrap();
            }
        }
        ring.sq.release();
        ring.cq.publish();
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::fs::remove_dir_all(dir);
    eprintln!("{c:?}");
    // Every class of garbage was met and reported as an error value, and
    // plausible descriptors still got through and were answered.
    assert!(c.valid > 100, "{c:?}");
    assert!(c.bad_entries > 100, "{c:?}");
    assert!(c.sq_index_errors > 10, "{c:?}");
    assert!(c.cq_index_errors > 10, "{c:?}");
    assert!(c.bad_buffers + c.buffer_index_errors > 0, "{c:?}");
    assert!(c.results_written > 0, "{c:?}");
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
#[ignore = "peer process of hostile_peer_cannot_crash_or_escape_the_consumer"]
fn scribbler_peer() {
    let Some((_sock, mut fds, _)) = common::connect_peer(1) else {
        return;
    };
    let seg = Segment::attach(fds.pop().unwrap()).unwrap();
    let v = seg.view();
    let l = RingLayout::attach(&v).unwrap();
    let seed = (std::process::id() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    eprintln!("scribbler seed {seed}");
    let mut rng = Rng(seed);
    let mut junk = vec![0u8; 8192];
    loop {
        match rng.below(10) {
            // Random bytes anywhere, header and indices included.
            0..=2 => {
                for b in junk.iter_mut() {
                    *b = rng.next() as u8;
                }
                let len = rng.below(junk.len() as u64) as usize;
                let off = rng.below(v.len() as u64) as usize;
                let len = len.min(v.len() - off);
                v.write_from(off, &junk[..len]).unwrap();
            }
            // Random index words.
            3 => {
                let words = [
                    word::SQ_HEAD,
                    word::SQ_TAIL,
                    word::CQ_HEAD,
                    word::CQ_TAIL,
                    word::BUF_HEAD,
                    word::BUF_TAIL,
                    word::SQ_CONSUMER_SLEEPING,
                    word::CQ_PRODUCER_SLEEPING,
                ];
                let w = words[rng.below(words.len() as u64) as usize];
                v.write(w, &(rng.next() as u32)).unwrap();
            }
            // Plausible descriptors, random fields, tail moved just ahead.
            4..=7 => {
                let head: u32 = v.read(word::SQ_HEAD).unwrap();
                let k = 1 + rng.below(32) as u32;
                for i in 0..k {
                    let op = Opcode::ALL[rng.below(Opcode::ALL.len() as u64) as usize];
                    let r = |rng: &mut Rng| {
                        if rng.below(4) == 0 {
                            BufRef::new(rng.next() as u32, rng.next() as u32)
                        } else {
                            BufRef::new(rng.below(1 << 16) as u32, rng.below(300) as u32)
                        }
                    };
                    let f = op.fields();
                    let sqe = Sqe {
                        user_data: rng.next(),
                        opcode: if rng.below(20) == 0 {
                            rng.next() as u8
                        } else {
                            op as u8
                        },
                        flags: (rng.below(2) as u8)
                            | if rng.below(20) == 0 {
                                rng.next() as u8
                            } else {
                                0
                            },
                        key_group: if f.keyed { rng.next() as u16 } else { 0 },
                        state_id: if f.keyed { rng.next() as u32 } else { 0 },
                        key: if f.keyed { r(&mut rng) } else { BufRef::NONE },
                        namespace: if f.keyed { r(&mut rng) } else { BufRef::NONE },
                        user_key: if f.user_key {
                            r(&mut rng)
                        } else {
                            BufRef::NONE
                        },
                        value: if f.value_in || f.output {
                            r(&mut rng)
                        } else {
                            BufRef::NONE
                        },
                        arg: rng.next(),
                        arg2: rng.next() as u32,
                        reserved: if rng.below(20) == 0 { 1 } else { 0 },
                    };
                    let slot = (head.wrapping_add(i) & (l.params.sq_entries - 1)) as usize;
                    v.write(l.sq_off + slot * 64, &sqe).unwrap();
                }
                v.write(word::SQ_TAIL, &head.wrapping_add(k)).unwrap();
            }
            // Provided buffers, some outside the arena; CQ head kept plausible.
            _ => {
                let head: u32 = v.read(word::BUF_HEAD).unwrap();
                for i in 0..8u32 {
                    let e = BufEntry {
                        off: if rng.below(3) == 0 {
                            rng.next() as u32
                        } else {
                            rng.below(60_000) as u32
                        },
                        len: rng.below(200) as u32,
                        buf_id: rng.next() as u32,
                        reserved: 0,
                    };
                    let slot = (head.wrapping_add(i) & (l.params.buf_entries - 1)) as usize;
                    v.write(l.buf_off + slot * 16, &e).unwrap();
                }
                v.write(word::BUF_TAIL, &head.wrapping_add(8)).unwrap();
                let cq_tail: u32 = v.read(word::CQ_TAIL).unwrap();
                v.write(word::CQ_HEAD, &cq_tail).unwrap();
            }
        }
    }
}
