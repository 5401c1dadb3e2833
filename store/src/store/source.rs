//! A layer a portable export reads in key order: a segment streamed from
//! the disk (see `stream`), or a frozen memtable, put in key order here in
//! steps of bounded work (see `crate::sorted`), so that an export never
//! waits for a memtable's flush.
//!
//! A memtable's records come out as its flush would write them
//! (`Memtable::resolve`): an export reads the same records whether the
//! memtable was flushed before it started or not, and emits the same bytes.

use super::*;
use crate::sorted::{Sort, Sorted};

/// Units of sorting work (`Sort::step`) between looks at the clock.
const SORT_UNITS: usize = 256;

/// Records whose loads start ahead of their use.
const AHEAD: usize = 8;

/// One captured layer, being read.
pub(super) enum Source {
    Segment(Cursor),
    Memtable(MemCursor),
}

/// A frozen memtable an export holds, let go off the shard's thread: the
/// export's may be the last reference (the flush ended meanwhile), and
/// freeing a memtable's memory takes milliseconds, as a flush's release
/// does (`crate::reuse::release`).
pub(super) struct HeldMemtable(Option<Arc<Memtable>>);

impl HeldMemtable {
    pub fn new(m: Arc<Memtable>) -> HeldMemtable {
        HeldMemtable(Some(m))
    }

    /// The memtable, until let go.
    pub fn get(&self) -> Option<&Arc<Memtable>> {
        self.0.as_ref()
    }

    fn release(&mut self) {
        if let Some(m) = self.0.take() {
            crate::helper::hand_off("stator-release", move || drop(m));
        }
    }
}

impl Drop for HeldMemtable {
    fn drop(&mut self) {
        self.release();
    }
}

/// A frozen memtable's records in key groups `lo..=hi`, in key order.
pub(super) struct MemCursor {
    /// Let go once every record is read.
    mem: HeldMemtable,
    lo: u16,
    hi: u16,
    phase: MemPhase,
    /// The current record's value, resolved.
    value: Vec<u8>,
}

enum MemPhase {
    Sorting(Box<Sort>),
    /// The sorted records, the current one and one past the last in the
    /// range.
    Reading {
        sorted: Sorted,
        at: usize,
        end: usize,
    },
    /// Every record was read; the memtable and the order are let go.
    Done,
}

/// A record taken from a source.
pub(super) struct Rec<'a> {
    pub kind: Kind,
    pub value: &'a [u8],
    /// The record as a segment stores it, when it is stored (then copied
    /// as it is).
    pub raw: Option<&'a [u8]>,
}

impl MemCursor {
    /// A cursor over `mem`'s records in key groups `lo..=hi` (nothing is
    /// sorted until [`Source::sort_until`]).
    pub fn new(mem: HeldMemtable, lo: u16, hi: u16) -> MemCursor {
        let m = mem.get().expect("a memtable not yet let go");
        let sort = Sort::new(m, crate::sorted::Buffers::default());
        MemCursor {
            mem,
            lo,
            hi,
            phase: MemPhase::Sorting(Box::new(sort)),
            value: Vec::new(),
        }
    }

    /// The memory a sort of `mem` holds: what an export counts for it.
    pub fn sort_bytes(mem: &Memtable) -> usize {
        mem.len() * crate::sorted::BYTES_PER_KEY
    }

    fn mem(&self) -> &Memtable {
        self.mem
            .get()
            .as_ref()
            .expect("read before the memtable was let go")
    }

    /// The first sorted record at or after key group `kg`'s first key.
    fn find(&self, sorted: &Sorted, kg: u16) -> usize {
        let start = keys::key_group_start(kg);
        let mem = self.mem();
        let (mut lo, mut hi) = (0, sorted.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let addr = sorted.get(mid).expect("in range");
            if mem.key_of(addr) < &start[..] {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

impl Source {
    /// Steps a memtable's sort until `deadline`. True once every record
    /// is in order (at once for a segment).
    pub fn sort_until(&mut self, deadline: Instant) -> bool {
        let Source::Memtable(m) = self else {
            return true;
        };
        let MemPhase::Sorting(sort) = &mut m.phase else {
            return true;
        };
        let mem = m.mem.get().expect("held while sorting");
        while !sort.step(mem, SORT_UNITS) {
            if crate::clock::now() >= deadline {
                return false;
            }
        }
        let sorted = sort.take_sorted();
        let at = m.find(&sorted, m.lo);
        let end = match m.hi.checked_add(1) {
            Some(next) => m.find(&sorted, next),
            None => sorted.len(),
        };
        m.phase = MemPhase::Reading { sorted, at, end };
        true
    }

    /// Steps past what is read and says where the source is.
    pub fn at(&mut self) -> At {
        match self {
            Source::Segment(c) => c.at(),
            Source::Memtable(m) => match &m.phase {
                MemPhase::Sorting(_) => At::Waiting,
                MemPhase::Reading { at, end, .. } if at < end => At::Record,
                MemPhase::Reading { .. } => {
                    m.phase = MemPhase::Done;
                    m.mem.release();
                    At::Finished
                }
                MemPhase::Done => At::Finished,
            },
        }
    }

    /// The current record's key (after `at` said `Record`).
    pub fn key(&self) -> &[u8] {
        match self {
            Source::Segment(c) => {
                let b = c.block().expect("a head has a current record");
                b.view().key(c.rec)
            }
            Source::Memtable(m) => match &m.phase {
                MemPhase::Reading { sorted, at, .. } => {
                    m.mem().key_of(sorted.get(*at).expect("a current record"))
                }
                MemPhase::Sorting(_) | MemPhase::Done => unreachable!("a head has a record"),
            },
        }
    }

    /// Takes the current record and moves past it.
    pub fn take(&mut self) -> Option<Rec<'_>> {
        match self {
            Source::Segment(c) => {
                let (b, at) = c.split();
                let v = b?.view();
                let rec = v.record(*at);
                *at += 1;
                Some(Rec {
                    kind: rec.kind,
                    value: rec.value,
                    raw: Some(v.raw(&rec)),
                })
            }
            Source::Memtable(m) => {
                let MemPhase::Reading { sorted, at, end } = &mut m.phase else {
                    return None;
                };
                if *at >= *end {
                    return None;
                }
                let addr = sorted.get(*at).expect("in range");
                *at += 1;
                if let Some(ahead) = sorted.get(*at + AHEAD) {
                    m.mem.get()?.prefetch_record(ahead);
                }
                m.value.clear();
                let kind = m.mem.get()?.resolve(addr, &mut m.value);
                Some(Rec {
                    kind,
                    value: &m.value,
                    raw: None,
                })
            }
        }
    }

    pub fn reads_in_flight(&self) -> usize {
        match self {
            Source::Segment(c) => c.reads_in_flight(),
            Source::Memtable(_) => 0,
        }
    }

    /// The segment file it reads, if it reads one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Source::Segment(c) => Some(c.seg.path.as_path()),
            Source::Memtable(_) => None,
        }
    }

    /// Memory it holds that the store's plan does not count: a memtable's
    /// sort, and the memtable itself once no longer `frozen` (its flush
    /// ended while the export reads it).
    pub fn memory(&self, frozen: &[(u64, Arc<Memtable>)]) -> usize {
        let Source::Memtable(m) = self else {
            return 0;
        };
        let Some(mem) = m.mem.get() else { return 0 };
        let sort = match &m.phase {
            MemPhase::Sorting(s) => s.bytes(),
            MemPhase::Reading { sorted, .. } => sorted.bytes(),
            MemPhase::Done => 0,
        };
        sort + outside_plan(mem, frozen)
    }
}

/// What memtable `m` holds outside the store's plan: all of it once it is
/// no longer `frozen` (its flush ended while an export reads it), else
/// nothing (the plan counts it).
pub(super) fn outside_plan(m: &Arc<Memtable>, frozen: &[(u64, Arc<Memtable>)]) -> usize {
    if frozen.iter().any(|(_, f)| Arc::ptr_eq(f, m)) {
        0
    } else {
        m.memory_bytes()
    }
}
