//! The session segment as the daemon reads it (`ring/PROTOCOL.md`): a
//! hostile client owns every byte of the segment and may rewrite any of
//! them at any time. The input is a script: the client scribbles words into
//! the control page and the queues, writes descriptors and provided-buffer
//! entries, and the daemon's end consumes descriptors, validates them,
//! completes them and takes buffers between the scribbles.
//!
//! Checked: nothing panics; every descriptor that validates names only
//! arena bytes, and every provided buffer that validates lies inside the
//! arena, so the daemon's copies through them cannot reach past it; a
//! corrupt index is an error, never a wild slot.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use stator_fuzz::Script;
use stator_ring::cqe::Cqe;
use stator_ring::header::RingParams;
use stator_ring::{ClientRing, DaemonRing, RingLayout};
use stator_shm::Segment;

const PARAMS: RingParams = RingParams {
    sq_entries: 64,
    cq_entries: 64,
    buf_entries: 64,
    arena_len: 64 << 10,
    chunk_len: 0,
};

fn segment() -> &'static Segment {
    static SEG: OnceLock<Segment> = OnceLock::new();
    SEG.get_or_init(|| {
        let len = RingLayout::new(PARAMS).expect("a valid layout").total_len;
        Segment::create(c"stator-fuzz-ring", len).expect("a memfd segment")
    })
}

fuzz_target!(|data: &[u8]| {
    let seg = segment();
    let view = seg.view();
    view.fill(0, view.len(), 0).expect("whole segment");
    let mut d = DaemonRing::create(view, PARAMS).expect("a fresh segment initializes");
    let layout = *d.layout();
    let arena = layout.arena;
    let in_arena = |off: usize, len: usize| {
        off >= arena.base
            && off
                .checked_add(len)
                .is_some_and(|e| e <= arena.base + arena.len)
    };
    let mut s = Script(data);
    let mut scratch = [0u8; 16];
    while let Some(op) = s.u8() {
        match op % 8 {
            // The client stores any word anywhere before the arena: the
            // header, the shared indices, the sleep flags, slots.
            0 => {
                let (Some(at), Some(v)) = (s.u16(), s.u32()) else {
                    break;
                };
                let off = (at as usize * 4) % arena.base;
                view.write(off, &v).expect("inside the segment");
            }
            // A whole descriptor into a submission slot.
            1 => {
                let (Some(slot), Some(b)) = (s.u8(), s.bytes(64)) else {
                    break;
                };
                let off = layout.sq_off + (slot as usize % 64) * 64;
                view.write_from(off, b).expect("inside the segment");
            }
            // A provided-buffer entry.
            2 => {
                let (Some(slot), Some(b)) = (s.u8(), s.bytes(16)) else {
                    break;
                };
                let off = layout.buf_off + (slot as usize % 64) * 16;
                view.write_from(off, b).expect("inside the segment");
            }
            // The daemon consumes what is published and validates it; a
            // valid descriptor's ranges are copied out as the shard does.
            3 => {
                let Ok(n) = d.sq.available() else { continue };
                assert!(n <= 64, "more available than the queue holds");
                for _ in 0..n {
                    let Ok(Some(sqe)) = d.sq.pop() else { break };
                    if let Ok(v) = sqe.validate(d.arena()) {
                        for r in [v.key, v.namespace, v.user_key, v.value] {
                            if r.len > 0 {
                                assert!(in_arena(r.off, r.len), "{r:?} outside the arena");
                                // Its first and last bytes, as a copy would
                                // touch them (a whole copy only costs time).
                                let n = r.len.min(16);
                                view.read_into(r.off, &mut scratch[..n]).expect("in bounds");
                                view.read_into(r.off + r.len - n, &mut scratch[..n])
                                    .expect("in bounds");
                            }
                        }
                    }
                }
                d.sq.release();
            }
            // The daemon completes; a full queue or a bad head is refused.
            4 => {
                let Some(n) = s.u8() else { break };
                for i in 0..n % 80 {
                    match d.cq.push(&Cqe {
                        user_data: i as u64,
                        ..Cqe::default()
                    }) {
                        Ok(true) => {}
                        Ok(false) | Err(_) => break,
                    }
                }
                d.cq.publish();
                let _ = d.cq.free();
            }
            // The daemon takes a provided buffer and writes a result into it.
            5 => match d.take_buffer() {
                Ok(Some(b)) => {
                    assert!(in_arena(b.seg_off, b.len), "{b:?} outside the arena");
                    view.fill(b.seg_off, b.len, 0xA5).expect("in bounds");
                }
                Ok(None) | Err(_) => {}
            },
            // The sleep protocol on both queues.
            6 => {
                if d.sq.prepare_sleep().is_ok() {
                    d.sq.end_sleep();
                }
                if d.cq.prepare_wait().is_ok() {
                    d.cq.end_wait();
                }
            }
            // A client attaching to whatever the control page now holds
            // (a daemon restarted under it, or a forged segment).
            _ => {
                if let Some(b) = s.bytes(128) {
                    view.write_from(0, b).expect("inside the control page");
                }
                let _ = ClientRing::attach(view);
            }
        }
    }
});
