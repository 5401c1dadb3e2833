//! Layout, validation and single-process queue behaviour of the protocol.

#![cfg(not(loom))]

use std::mem::offset_of;

use stator_ring::bufring::BufEntry;
use stator_ring::header::{Header, RingLayout, RingParams, features, word};
use stator_ring::session::{ClientRing, DaemonRing};
use stator_ring::{AttachError, BufRef, Cqe, Opcode, QueueError, Sqe, SqeError, Status, sqe_flags};
use stator_shm::Segment;
use stator_shm::arena::ArenaRegion;

#[test]
fn entry_sizes_and_offsets() {
    assert_eq!(size_of::<Sqe>(), 64);
    assert_eq!(align_of::<Sqe>(), 8);
    assert_eq!(offset_of!(Sqe, user_data), 0);
    assert_eq!(offset_of!(Sqe, opcode), 8);
    assert_eq!(offset_of!(Sqe, flags), 9);
    assert_eq!(offset_of!(Sqe, key_group), 10);
    assert_eq!(offset_of!(Sqe, state_id), 12);
    assert_eq!(offset_of!(Sqe, key), 16);
    assert_eq!(offset_of!(Sqe, namespace), 24);
    assert_eq!(offset_of!(Sqe, user_key), 32);
    assert_eq!(offset_of!(Sqe, value), 40);
    assert_eq!(offset_of!(Sqe, arg), 48);
    assert_eq!(offset_of!(Sqe, arg2), 56);
    assert_eq!(offset_of!(Sqe, reserved), 60);
    assert_eq!(size_of::<BufRef>(), 8);

    assert_eq!(size_of::<Cqe>(), 32);
    assert_eq!(offset_of!(Cqe, user_data), 0);
    assert_eq!(offset_of!(Cqe, status), 8);
    assert_eq!(offset_of!(Cqe, flags), 12);
    assert_eq!(offset_of!(Cqe, buf_id), 16);
    assert_eq!(offset_of!(Cqe, len), 20);
    assert_eq!(offset_of!(Cqe, aux), 24);

    assert_eq!(size_of::<BufEntry>(), 16);
    assert_eq!(offset_of!(BufEntry, off), 0);
    assert_eq!(offset_of!(BufEntry, len), 4);
    assert_eq!(offset_of!(BufEntry, buf_id), 8);
    assert_eq!(offset_of!(BufEntry, reserved), 12);
}

#[test]
fn header_layout() {
    assert_eq!(size_of::<Header>(), 256);
    assert_eq!(offset_of!(Header, magic), 0);
    assert_eq!(offset_of!(Header, version_major), 8);
    assert_eq!(offset_of!(Header, version_minor), 10);
    assert_eq!(offset_of!(Header, control_len), 12);
    assert_eq!(offset_of!(Header, features), 16);
    assert_eq!(offset_of!(Header, segment_len), 24);
    assert_eq!(offset_of!(Header, sq_entries), 32);
    assert_eq!(offset_of!(Header, cq_entries), 36);
    assert_eq!(offset_of!(Header, buf_entries), 40);
    assert_eq!(offset_of!(Header, sqe_size), 44);
    assert_eq!(offset_of!(Header, cqe_size), 46);
    assert_eq!(offset_of!(Header, sq_off), 48);
    assert_eq!(offset_of!(Header, cq_off), 56);
    assert_eq!(offset_of!(Header, buf_off), 64);
    assert_eq!(offset_of!(Header, arena_off), 72);
    assert_eq!(offset_of!(Header, arena_len), 80);
    assert_eq!(offset_of!(Header, chunk_off), 88);
    assert_eq!(offset_of!(Header, chunk_len), 96);
    assert_eq!(offset_of!(Header, reserved), 104);
    // Shared words: each on its own 128-byte line, inside the control page,
    // after the header fields.
    let words = [
        word::SQ_HEAD,
        word::SQ_TAIL,
        word::CQ_HEAD,
        word::CQ_TAIL,
        word::BUF_HEAD,
        word::BUF_TAIL,
        word::SQ_CONSUMER_SLEEPING,
        word::SQ_PRODUCER_SLEEPING,
        word::CQ_CONSUMER_SLEEPING,
        word::CQ_PRODUCER_SLEEPING,
        word::BUF_CONSUMER_SLEEPING,
        word::BUF_PRODUCER_SLEEPING,
    ];
    for (i, w) in words.iter().enumerate() {
        assert_eq!(w % 128, 0, "word {i} not line-aligned");
        assert!(*w >= 256 && *w < 4096);
        assert!(*w != word::READY & !127, "word {i} shares the ready line");
    }
    let mut sorted = words.to_vec();
    sorted.dedup();
    assert_eq!(sorted.len(), words.len());
}

#[test]
fn layout_rules() {
    for bad in [0, 32, 100, 1 << 21] {
        let p = RingParams {
            sq_entries: bad,
            ..RingParams::default()
        };
        assert!(RingLayout::new(p).is_err(), "sq_entries {bad} accepted");
    }
    for good in [64, 1024, 65_536, 1 << 20] {
        let p = RingParams {
            sq_entries: good,
            cq_entries: good,
            buf_entries: good,
            ..RingParams::default()
        };
        let l = RingLayout::new(p).unwrap();
        assert_eq!(l.sq_off, 4096);
        assert!(l.cq_off >= l.sq_off + 64 * good as usize);
        assert!(l.buf_off >= l.cq_off + 32 * good as usize);
        assert!(l.arena.base >= l.buf_off + 16 * good as usize);
        assert_eq!(l.arena.base % 4096, 0);
        assert_eq!(l.total_len % 4096, 0);
        assert_eq!(l.features, features::BUF_RING);
    }
    assert!(
        RingLayout::new(RingParams {
            arena_len: 0,
            ..RingParams::default()
        })
        .is_err()
    );
    assert!(
        RingLayout::new(RingParams {
            arena_len: (1 << 32) + 1,
            ..RingParams::default()
        })
        .is_err()
    );
}

fn small() -> RingParams {
    RingParams {
        sq_entries: 64,
        cq_entries: 64,
        buf_entries: 64,
        arena_len: 1 << 16,
        chunk_len: 4096,
    }
}

fn segment(p: RingParams) -> Segment {
    Segment::create(c"test", RingLayout::new(p).unwrap().total_len).unwrap()
}

#[test]
fn attach_checks_header() {
    let seg = segment(small());
    let v = seg.view();
    assert_eq!(
        ClientRing::attach(v).err().map(|e| e.to_string()),
        Some(AttachError::NotReady.to_string())
    );
    let d = DaemonRing::create(v, small()).unwrap();
    let c = ClientRing::attach(v).unwrap();
    assert_eq!(c.layout(), d.layout());
    // Each corruption is a clear, typed error.
    let corrupt = |off: usize, bytes: &[u8]| {
        let seg2 = segment(small());
        DaemonRing::create(seg2.view(), small()).unwrap();
        seg2.view().write_from(off, bytes).unwrap();
        ClientRing::attach(seg2.view())
            .err()
            .expect("corrupt header accepted")
            .to_string()
    };
    assert!(corrupt(0, b"XXXXXXXX").contains("bad magic"));
    assert!(corrupt(8, &2u16.to_le_bytes()).contains("protocol version 2.0"));
    assert!(corrupt(16, &(1u64 << 40).to_le_bytes()).contains("unsupported feature"));
    assert!(corrupt(32, &100u32.to_le_bytes()).contains("power of two"));
    assert!(corrupt(48, &8192u64.to_le_bytes()).contains("sq_off"));
    // Reserved header bytes are ignored by readers (minor versions may use them).
    let seg4 = segment(small());
    DaemonRing::create(seg4.view(), small()).unwrap();
    seg4.view().write_from(200, &[1]).unwrap();
    assert!(ClientRing::attach(seg4.view()).is_ok());
    // Not a Stator segment at all.
    let seg5 = segment(small());
    seg5.view().write_from(0, b"GARBAGE!").unwrap();
    assert!(
        ClientRing::attach(seg5.view())
            .err()
            .unwrap()
            .to_string()
            .contains("bad magic")
    );
    assert!(corrupt(24, &1u64.to_le_bytes()).contains("segment_len"));
    // A layout larger than the segment.
    let seg3 = segment(small());
    let big = RingParams {
        arena_len: 1 << 20,
        ..small()
    };
    assert!(DaemonRing::create(seg3.view(), big).is_err());
}

#[test]
fn submit_complete_provide_roundtrip() {
    let seg = segment(small());
    let mut d = DaemonRing::create(seg.view(), small()).unwrap();
    let mut c = ClientRing::attach(seg.view()).unwrap();
    let arena = c.arena();
    arena.write_from(128, b"key").unwrap();
    let sqe = Sqe {
        user_data: 7,
        opcode: Opcode::Get as u8,
        flags: sqe_flags::BUFFER_SELECT,
        state_id: 1,
        key_group: 3,
        key: BufRef::new(128, 3),
        ..Sqe::default()
    };
    assert!(c.sq.push(&sqe).unwrap());
    assert!(!c.sq.publish(), "daemon is not asleep");
    c.bufs
        .as_mut()
        .unwrap()
        .push(&BufEntry {
            off: 4096,
            len: 100,
            buf_id: 9,
            reserved: 0,
        })
        .unwrap();
    c.bufs.as_mut().unwrap().publish();

    let got = d.sq.pop().unwrap().unwrap();
    assert_eq!(got, sqe);
    let v = got.validate(d.arena()).unwrap();
    let mut key = [0u8; 3];
    d.view().read_into(v.key.off, &mut key).unwrap();
    assert_eq!(&key, b"key");
    let buf = d.take_buffer().unwrap().unwrap();
    assert_eq!(buf.buf_id, 9);
    d.view().write_from(buf.seg_off, b"value").unwrap();
    d.sq.release();
    d.cq.push(&Cqe {
        user_data: 7,
        status: 0,
        flags: 1,
        buf_id: 9,
        len: 5,
        aux: 0,
    })
    .unwrap();
    d.cq.publish();

    let cqe = c.cq.pop().unwrap().unwrap();
    assert_eq!(cqe.user_data, 7);
    assert_eq!(cqe.status_code(), Some(Status::Ok));
    let mut val = [0u8; 5];
    arena.read_into(4096, &mut val).unwrap();
    assert_eq!(&val, b"value");
    assert_eq!(c.cq.pop().unwrap(), None);
}

#[test]
fn full_and_empty() {
    let seg = segment(small());
    let mut d = DaemonRing::create(seg.view(), small()).unwrap();
    let mut c = ClientRing::attach(seg.view()).unwrap();
    assert_eq!(d.sq.pop().unwrap(), None);
    for i in 0..64 {
        assert!(
            c.sq.push(&Sqe {
                user_data: i,
                ..Sqe::default()
            })
            .unwrap()
        );
    }
    assert!(
        !c.sq.push(&Sqe::default()).unwrap(),
        "65th push into 64 slots"
    );
    c.sq.publish();
    // Wrap around many times with a partial drain each round.
    let mut next_in = 64u64;
    let mut next_out = 0u64;
    for round in 0..1000 {
        let k = 1 + round % 64;
        for _ in 0..k {
            let e = d.sq.pop().unwrap().unwrap();
            assert_eq!(e.user_data, next_out);
            next_out += 1;
        }
        d.sq.release();
        for _ in 0..k {
            assert!(
                c.sq.push(&Sqe {
                    user_data: next_in,
                    ..Sqe::default()
                })
                .unwrap()
            );
            next_in += 1;
        }
        assert!(!c.sq.push(&Sqe::default()).unwrap());
        c.sq.publish();
    }
}

#[test]
fn peer_indices_are_validated() {
    let seg = segment(small());
    let mut d = DaemonRing::create(seg.view(), small()).unwrap();
    let mut c = ClientRing::attach(seg.view()).unwrap();
    // Client publishes a tail 65 ahead of the daemon's head: impossible.
    seg.view().write(word::SQ_TAIL, &65u32).unwrap();
    assert!(matches!(
        d.sq.pop(),
        Err(QueueError::BadTail { tail: 65, .. })
    ));
    // A tail "behind" the head (wrapping) is also refused.
    seg.view().write(word::SQ_TAIL, &u32::MAX).unwrap();
    assert!(matches!(d.sq.pop(), Err(QueueError::BadTail { .. })));
    seg.view().write(word::SQ_TAIL, &0u32).unwrap();
    assert_eq!(d.sq.pop().unwrap(), None);
    // Client moves the CQ head beyond what the daemon published.
    for i in 0..64 {
        d.cq.push(&Cqe {
            user_data: i,
            ..Cqe::default()
        })
        .unwrap();
    }
    d.cq.publish();
    seg.view().write(word::CQ_HEAD, &100u32).unwrap();
    assert!(matches!(
        d.cq.push(&Cqe::default()),
        Err(QueueError::BadHead { head: 100, .. })
    ));
    // Daemon side scribbling the SQ head is caught by the client.
    for _ in 0..64 {
        c.sq.push(&Sqe::default()).unwrap();
    }
    seg.view().write(word::SQ_HEAD, &1000u32).unwrap();
    assert!(matches!(
        c.sq.push(&Sqe::default()),
        Err(QueueError::BadHead { .. })
    ));
}

#[test]
fn descriptor_validation() {
    let arena = ArenaRegion {
        base: 1 << 20,
        len: 4096,
    };
    let ok = Sqe {
        opcode: Opcode::Put as u8,
        key: BufRef::new(0, 8),
        value: BufRef::new(64, 100),
        state_id: 2,
        key_group: 5,
        ..Sqe::default()
    };
    let v = ok.validate(&arena).unwrap();
    assert_eq!(v.key.off, 1 << 20);
    let append_all = Sqe {
        opcode: Opcode::ListAppend as u8,
        flags: sqe_flags::ELEMENTS,
        ..ok
    };
    assert_eq!(
        append_all.validate(&arena).unwrap().flags,
        sqe_flags::ELEMENTS
    );
    assert_eq!(v.value.off, (1 << 20) + 64);
    let cases: Vec<(Sqe, SqeError)> = vec![
        (Sqe { opcode: 200, ..ok }, SqeError::BadOpcode(200)),
        (
            Sqe { flags: 0x80, ..ok },
            SqeError::BadFlags {
                op: Opcode::Put,
                flags: 0x80,
            },
        ),
        (
            Sqe {
                flags: sqe_flags::BUFFER_SELECT,
                ..ok
            },
            SqeError::BadFlags {
                op: Opcode::Put,
                flags: 1,
            },
        ),
        (
            // ELEMENTS belongs to ListAppend alone.
            Sqe {
                flags: sqe_flags::ELEMENTS,
                ..ok
            },
            SqeError::BadFlags {
                op: Opcode::Put,
                flags: sqe_flags::ELEMENTS,
            },
        ),
        (Sqe { reserved: 1, ..ok }, SqeError::Reserved(1)),
        (
            Sqe {
                key: BufRef::new(4090, 8),
                ..ok
            },
            SqeError::OutOfArena {
                field: "key",
                off: 4090,
                len: 8,
                bound: 4096,
            },
        ),
        (
            Sqe {
                value: BufRef::new(u32::MAX, 2),
                ..ok
            },
            SqeError::OutOfArena {
                field: "value",
                off: u32::MAX,
                len: 2,
                bound: 4096,
            },
        ),
        (
            Sqe {
                user_key: BufRef::new(0, 1),
                ..ok
            },
            SqeError::UnexpectedField {
                op: Opcode::Put,
                field: "user_key",
            },
        ),
        (
            Sqe {
                opcode: Opcode::Get as u8,
                ..ok
            },
            SqeError::BadFlags {
                op: Opcode::Get,
                flags: 0,
            },
        ),
        (
            Sqe {
                opcode: Opcode::Nop as u8,
                key: BufRef::NONE,
                value: BufRef::NONE,
                ..ok
            },
            SqeError::UnexpectedField {
                op: Opcode::Nop,
                field: "state_id/key_group",
            },
        ),
    ];
    for (sqe, want) in cases {
        let got = sqe.validate(&arena);
        // The Get case: value is the output buffer and is set, so it passes.
        if sqe.opcode == Opcode::Get as u8 {
            assert!(got.is_ok(), "{got:?}");
            continue;
        }
        assert_eq!(got, Err(want), "{sqe:?}");
        assert!(Status::from(want) as i32 <= -1);
    }
    let get_no_out = Sqe {
        opcode: Opcode::Get as u8,
        value: BufRef::NONE,
        ..ok
    };
    assert_eq!(
        get_no_out.validate(&arena),
        Err(SqeError::NoOutput { op: Opcode::Get })
    );
    // Every opcode round-trips through its number; unknown ones do not.
    for op in Opcode::ALL {
        assert_eq!(Opcode::from_u8(*op as u8), Some(*op));
    }
    for v in (Opcode::ALL.len() as u8)..=255 {
        assert_eq!(Opcode::from_u8(v), None);
    }
    for s in Status::ALL {
        assert_eq!(Status::from_i32(*s as i32), Some(*s));
        assert!(!s.message().is_empty());
    }
}

#[test]
fn provided_buffer_outside_arena_is_reported() {
    let seg = segment(small());
    let mut d = DaemonRing::create(seg.view(), small()).unwrap();
    let mut c = ClientRing::attach(seg.view()).unwrap();
    let br = c.bufs.as_mut().unwrap();
    br.push(&BufEntry {
        off: 65_000,
        len: 1000,
        buf_id: 1,
        reserved: 0,
    })
    .unwrap();
    br.push(&BufEntry {
        off: 0,
        len: 10,
        buf_id: 2,
        reserved: 3,
    })
    .unwrap();
    br.push(&BufEntry {
        off: 0,
        len: 10,
        buf_id: 3,
        reserved: 0,
    })
    .unwrap();
    br.publish();
    assert!(d.take_buffer().is_err());
    assert!(d.take_buffer().is_err());
    assert_eq!(d.take_buffer().unwrap().unwrap().buf_id, 3);
    assert_eq!(d.take_buffer().unwrap(), None);
}

/// A consumer that took more than it can serve puts the rest back: the
/// next pops return the same entries, the producer's slots stay reserved
/// until released, and an unpop past what is unreleased is refused.
#[test]
fn unpopped_entries_come_back_in_order() {
    let seg = segment(small());
    let mut d = DaemonRing::create(seg.view(), small()).unwrap();
    let mut c = ClientRing::attach(seg.view()).unwrap();
    for i in 0..4u64 {
        let sqe = Sqe {
            user_data: i,
            ..Sqe::default()
        };
        assert!(c.sq.push(&sqe).unwrap());
    }
    c.sq.publish();
    let a = d.sq.pop().unwrap().unwrap();
    let b = d.sq.pop().unwrap().unwrap();
    let _ = d.sq.pop().unwrap().unwrap();
    assert_eq!((a.user_data, b.user_data), (0, 1));
    d.sq.unpop(2);
    assert_eq!(d.sq.available().unwrap(), 3);
    let got: Vec<u64> = std::iter::from_fn(|| d.sq.pop().unwrap().map(|s| s.user_data)).collect();
    assert_eq!(got, [1, 2, 3]);
    d.sq.release();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.sq.unpop(1)));
    assert!(r.is_err(), "released entries cannot be put back");
}
